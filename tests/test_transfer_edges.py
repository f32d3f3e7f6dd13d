"""Weights transfer at its edges (rollout_cluster/transfer, and how router/weights.py and
client/fleet_ops.py use it): a push whose abort came before its order is refused when the order
comes; a tensor the relay refuses for its size still ends the trainer's send; an IPC push whose
release timed out closes its lease's descriptor; a name that is no str is refused naming it.
(A review found each.) Driven without Ray: RouterCore in this process, real TCPStores between
threads, an IPC lease file in tmp_path."""
import os
import threading
import types
import time

import pytest
import torch

from rollout_cluster.protocol import InputError, LoadWeights, NoteWeights
from rollout_cluster.transfer.push import PUSH_SCHEME

from test_fleet_sleep import core_with, pull

SRC = f"{PUSH_SCHEME}review1"


# --- router/weights.py: a push_abort that overtakes its own order --------------------------------

def test_a_push_whose_abort_came_before_its_order_is_not_taken_afterwards():
    """push.py sends push_abort when the order's answer did not come in time ("the router may
    have taken it": test_push_abort.test_a_trainer_whose_first_order_got_no_answer_aborts_too).
    The order may also not have been *processed* yet: Router.push_weights first awaits its nonce's
    journal write in a thread (`_order`, "the GCS may be slow"), and push_abort's own write can
    finish first. FleetWeights.abort (router/weights.py:155) then returns None for a source that
    is not the current push and remembers nothing, so the order that lands next is taken: the
    fleet moves to a streamed push whose trainer has already raised and will send no more objects.
    Its lease answers (the trainer lives), so only STALL_S ends it: every replica loads bucket 0,
    waits 60 s, breaks its weights and reloads, and the router aborts the push itself.

    Right: an abort of a push the router has not seen is remembered (as `aborted_reasons` is for
    an aborted push), and a push_weights order of that source that comes later is refused naming
    `source`, leaving the fleet where it was."""
    core = core_with(("a",))
    out = core.abort_push(SRC, "the trainer's push failed: TimeoutError: no answer in 120 s")
    assert out == {"aborted": None, "version": 0}  # nothing to abort yet: the order has not landed
    try:
        v = core.update_weights(SRC, None, ("m", "b0"), total=4)
    except InputError as e:
        assert e.field == "source", e
        return
    orders = [c for c in pull(core, "a", 1.0).control if isinstance(c, (LoadWeights, NoteWeights))]
    st = core.weights_status()
    pytest.fail(f"the order of {SRC}, aborted by its trainer before it landed, was taken as version {v} "
                f"(streaming={st['streaming']}); replica a was ordered {orders}")


# --- channels.py: a tensor refused for its size is left in the store, unacknowledged ------------

def test_a_tensor_refused_for_its_size_does_not_leave_the_trainers_send_waiting_out_the_store():
    """CpuChannel.receive (channels.py:283-288) raises on a size mismatch before it deletes the
    key and sets its ack. The trainer's CpuSender.send waits for that ack, so it hangs until the
    store's timeout (300 s by default) although the relay has already refused the tensor and
    answered; and the bytes stay under the same numbered key with `received` unchanged, so the
    relay's next receive on this channel reads the refused bytes again as the next tensor. The
    relay's own rule (relay.py `_drain`: a refused tensor is still received so that the trainer's
    broadcast ends) is broken on the CPU channel, as an NCCL broadcast would have completed.

    Right: the refused tensor is taken out of the store (key deleted, ack set, counted) before the
    error is raised, so the sender returns at once and both ends stay in step."""
    from ports import free_port
    from rollout_cluster.transfer.channels import CpuChannel, CpuSender

    port = free_port()
    sender = CpuSender("127.0.0.1", port, 2, hosts_store=True, timeout_s=8)
    channel = CpuChannel("127.0.0.1", port, 2, hosts_store=False, timeout_s=8)
    done = {}

    def send():
        t0 = time.monotonic()
        try:
            sender.send(torch.ones(5, dtype=torch.bfloat16))  # 10 bytes; the relay was told float32 [5]
            done["out"] = "sent"
        except Exception as e:  # noqa: BLE001
            done["out"] = f"{type(e).__name__}: {e}"
        done["s"] = time.monotonic() - t0

    th = threading.Thread(target=send, daemon=True)
    th.start()
    with pytest.raises(ValueError, match="10 bytes arrived, 20 announced"):
        channel.receive([5], torch.float32)
    th.join(3.0)
    still_waiting = th.is_alive()
    th.join(20)  # (the store's timeout ends it: cleanup)
    assert not still_waiting, (f"the trainer's send still waited for its ack 3 s after the relay refused the "
                               f"tensor; it ended after {done.get('s', 0):.1f} s with {done.get('out')}")


# --- ipc.py: a release that timed out keeps the lease's descriptor open ---------------------------

def test_a_push_whose_release_timed_out_closes_the_trainers_lease_descriptor(tmp_path, monkeypatch):
    """An IPC push whose release() timed out (a replica still held its shared lock) keeps the
    tensors (on purpose) and unlinks the lease; release() leaves its descriptor open for a later
    release(). push_weights makes no later one: it abandons the hold, which closes the descriptor
    (before, nothing did: every such push leaked one, and the unlinked lease's inode in /dev/shm,
    for the rest of the trainer's process)."""
    from rollout_cluster.client import fleet_ops
    from rollout_cluster.transfer import ipc as ipc_mod
    from rollout_cluster.transfer import push as push_mod
    from rollout_cluster.transfer.ipc import IpcHold, hold_lease, unpack_ipc

    hold = IpcHold.start(str(tmp_path))
    bucket = unpack_ipc({"names": ["a"], "dtypes": ["bfloat16"], "shapes": [[2]], "gpu_uuid": "GPU-x",
                         "ipc": b"", "nbytes": 4, "lease": hold.lease, "host": hold.host})
    reader = hold_lease(bucket)  # a replica still loading
    fd, kept = hold.fd, list(ipc_mod._KEPT)
    monkeypatch.setattr(IpcHold, "start", classmethod(lambda cls, directory=None: hold))
    monkeypatch.setattr(fleet_ops, "before_update", lambda client, running, deadline: None)
    monkeypatch.setattr(push_mod, "push", lambda *a, **k: (3, "push://x", None))
    monkeypatch.setattr(fleet_ops, "wait_for_version", lambda *a, **k: 3)
    client = types.SimpleNamespace(status=lambda: {"sleep": {"level": 0}},
                                   router=types.SimpleNamespace(handle=None, signer=None), call_timeout_s=5.0)
    try:
        assert fleet_ops.push_weights(client, [("w", None)], None, 1 << 20, timeout_s=0.1, transport="ipc") == 3
        assert not os.path.exists(hold.lease)  # unlinked: no later replica opens the tensors
        with pytest.raises(OSError):
            os.fstat(fd)  # closed
        assert ipc_mod._KEPT[-1] is hold.tensors  # the tensors are kept, never freed under the reader
    finally:
        os.close(reader)
        ipc_mod._KEPT[:] = kept


# --- buckets.py: the pair check's message names neither the item nor what is wrong -------------

def test_a_pair_whose_name_is_no_str_is_refused_naming_the_name():
    """buckets.checked (buckets.py:40-41) refuses `(0, tensor)` (an int name, e.g. enumerate()'s
    index) with "named_tensors: expected (name, tensor) pairs, got tuple": it did get a
    (name, tensor) tuple, so the message contradicts the input, and it names neither the offending
    name nor that a name must be a str.

    Right: the message names the value refused (the name 0, its type) and says a name must be a str."""
    from rollout_cluster.transfer.buckets import pack

    with pytest.raises(TypeError) as e:
        list(pack([(0, torch.ones(2))]))
    message = str(e.value)
    assert "str" in message and "0" in message.replace("named_tensors", ""), message


def test_an_nccl_channel_frees_its_communicator_when_closed():
    """A relay opens one NCCL communicator per trainer session (init_communicator): close() must
    free it (vLLM's PyNcclCommunicator.destroy), not only drop the reference, or every session
    leaves its NCCL buffers on the device. Closing twice frees once; a vLLM without destroy is
    dropped as before."""
    from rollout_cluster.transfer.channels import NcclChannel

    class Comm:
        destroyed = 0

        def destroy(self):
            Comm.destroyed += 1

    ch = NcclChannel.__new__(NcclChannel)  # (no GPU here: the channel's state, as __init__ leaves it)
    ch.comm = Comm()
    ch.close()
    ch.close()
    assert Comm.destroyed == 1 and ch.comm is None
    ch.comm = object()  # a communicator without destroy
    ch.close()
    assert ch.comm is None
