"""The replica resets the niceness Ray gives its workers (15) before the engine spawns."""
import multiprocessing
import os

from rollout_cluster.engines.vllm_engine import set_niceness


def _child(queue) -> None:
    os.setpriority(os.PRIO_PROCESS, 0, 10)
    raised = set_niceness(12)  # a lower priority is always allowed
    after_raise = os.getpriority(os.PRIO_PROCESS, 0)
    lowered = set_niceness(0)  # a higher priority needs CAP_SYS_NICE
    after_lower = os.getpriority(os.PRIO_PROCESS, 0)
    untouched = set_niceness(None)
    queue.put((raised, after_raise, lowered, after_lower, untouched, os.getpriority(os.PRIO_PROCESS, 0)))


def test_set_niceness_in_a_child_process():
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue,))
    proc.start()
    raised, after_raise, lowered, after_lower, untouched, final = queue.get(timeout=60)
    proc.join(timeout=60)
    assert raised is None and after_raise == 12
    if after_lower == 0:  # privileged (root, as in CI)
        assert lowered is None
    else:  # unprivileged: the warning names the setting and the other fix
        assert after_lower == 12 and "engine.niceness" in lowered and "RAY_worker_niceness=0" in lowered
    assert untouched is None and final == after_lower
