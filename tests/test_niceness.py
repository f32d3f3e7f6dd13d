"""The replica resets the niceness Ray gives its workers (15) before the engine spawns."""
import multiprocessing
import os

from rollout_cluster.niceness import set_niceness


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


def _child_threads(queue) -> None:
    import threading
    os.setpriority(os.PRIO_PROCESS, 0, 10)
    started, stop = threading.Event(), threading.Event()

    def worker():
        started.set()
        stop.wait(30)

    t = threading.Thread(target=worker)
    t.start()
    started.wait(10)
    warning = set_niceness(14, "router.niceness", all_threads=True)
    niceness = {tid: os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir("/proc/self/task")}
    stop.set()
    t.join()
    queue.put((warning, niceness))


def test_set_niceness_of_every_thread():
    """The router's setting reaches every thread of its process (Serve runs user code off the main thread)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_threads, args=(queue,))
    proc.start()
    warning, niceness = queue.get(timeout=60)
    proc.join(timeout=60)
    assert warning is None
    assert len(niceness) >= 2 and set(niceness.values()) == {14}
