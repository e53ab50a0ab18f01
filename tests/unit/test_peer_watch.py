"""The peer watch and the stderr helper, in-process: a fake key-value store stands in for jax's coordination
service, and recorded jax stderr (a CI run's) for the C++ abort."""
import io
import threading
import time

from jaxmem.train.peer_watch import _DONE, _PREFIX, PeerWatch
from jaxmem.runtime.stderr_guard import filter_stream


class FakeService:
    """jax's client API as the watch uses it: set with overwrite, try_get raising NOT_FOUND."""

    def __init__(self):
        self.store, self.down, self.broken_prefixes = {}, False, set()

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.down:
            raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
        self.store[key] = value

    def key_value_try_get(self, key):
        if self.down or any(key.startswith(p) for p in self.broken_prefixes):
            raise RuntimeError("UNAVAILABLE: the service is shutting down")
        if key not in self.store:
            raise RuntimeError(f"NOT_FOUND: {key} not found")
        return self.store[key]


def _watch(service, me, count=2):
    lost = []
    event = threading.Event()

    def on_lost(process, why):
        lost.append((process, why))
        event.set()

    watch = PeerWatch(service, me, count, on_lost, stale_s=0.4, period_s=0.05).start()
    return watch, lost, event


def _beat(service, process, seconds):
    end = time.monotonic() + seconds
    beat = 0
    while time.monotonic() < end:
        beat += 1
        service.store[f"{_PREFIX}{process}"] = str(beat)
        time.sleep(0.05)


def test_a_silent_peer_is_lost_and_a_beating_one_is_not():
    service = FakeService()
    watch, lost, event = _watch(service, me=0)
    _beat(service, 1, 1.0)  # 2.5 stale periods of beats: not lost while it beats
    assert lost == []
    assert event.wait(5)
    watch.stop()
    assert lost[0][0] == 1 and lost[0][1].startswith("no heartbeat for")
    assert service.store[f"{_DONE}0"] == "1"


def test_a_peer_that_finished_the_run_is_not_lost():
    service = FakeService()
    watch, lost, event = _watch(service, me=0)
    _beat(service, 1, 0.3)
    service.store[f"{_DONE}1"] = "1"
    assert not event.wait(1.2)
    watch.stop()
    assert lost == []


def test_a_service_error_on_the_done_key_still_ends_the_survivor():
    """The watch thread must not die on an error from the service while it decides (the CI failure of stop 34:
    jax's own heartbeat then aborted the survivor from C++)."""
    service = FakeService()
    service.broken_prefixes.add(_DONE)
    watch, lost, event = _watch(service, me=0)
    _beat(service, 1, 0.2)
    assert event.wait(5)
    watch.stop()
    assert lost[0][0] == 1


def test_a_coordinator_that_stops_answering_is_lost_for_the_others_only():
    service = FakeService()
    watch, lost, event = _watch(service, me=1)
    _beat(service, 0, 0.2)
    service.down = True
    assert event.wait(6)  # three seconds of failures at most (min(3, stale_s) = 0.4 here)
    watch.stop()
    assert lost[0][0] == 0 and "the coordinator stopped answering" in lost[0][1]
    assert "UNAVAILABLE" in lost[0][1]


_ABORT = (
    "F1126 16:53:11.480000   24732 client.cc:112] Terminating process because the JAX distributed service detected "
    "fatal errors. This most likely indicates that another task died; see the other task logs for more details.\n"
    "*** Check failure stack trace: ***\n"
    + "".join(f"    @     0x7f00000{i:05x}  (unknown)\n" for i in range(60)))  # longer than the lines it keeps
_SILENT_PEER = (
    "E1126 16:53:11.472066   24778 coordination_service.cc:1549] [4929564551861229675] Use error polling to "
    "propagate the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped sending "
    "heartbeats):\n1\nThe tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. "
    "preemption, eviction) to debug further. [type.googleapis.com/tensorflow.CoordinationServiceError='']\n")
_LEADER_GONE = (
    "E1126 16:53:11.472066   24778 coordination_service_agent.cc:332] Polled an error from coordination service "
    "(this can be an error from this or another task).\n")


def _filtered(text, tmp_path):
    (tmp_path / "ckpt" / "4").mkdir(parents=True)
    (tmp_path / "ckpt" / "6.orbax-checkpoint-tmp-1").mkdir()
    sink = io.StringIO()
    filter_stream(io.BytesIO(text.encode()), sink, str(tmp_path / "ckpt"))
    return sink.getvalue()


def test_the_helper_names_the_silent_peer_when_jax_heartbeat_aborts_the_coordinator(tmp_path):
    out = _filtered("jaxmem train: step 4\n" + _SILENT_PEER + _ABORT, tmp_path)
    last = out.strip().splitlines()[-1]
    assert last == ("jaxmem train: lost process 1 (no heartbeat reached jax's coordination service); jax stopped "
                    f"this process; the last saved checkpoint is step 4 in {tmp_path / 'ckpt'}; restart every "
                    "process with the same command to resume")
    assert out.startswith("jaxmem train: step 4\n")
    assert "Check failure" not in out and "LogMessageFatal" not in out


def test_the_helper_names_the_coordinator_when_its_service_is_gone(tmp_path):
    out = _filtered(_LEADER_GONE + _ABORT, tmp_path)
    assert out.strip().splitlines() == [
        "jaxmem train: lost process 0 (the coordinator: its service stopped answering); jax stopped this process; "
        f"the last saved checkpoint is step 4 in {tmp_path / 'ckpt'}; restart every process with the same command "
        "to resume"]


def test_held_lines_pass_through_when_no_abort_follows(tmp_path):
    assert _filtered(_LEADER_GONE + "jaxmem train: done\n", tmp_path) == _LEADER_GONE + "jaxmem train: done\n"
