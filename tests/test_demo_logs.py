"""The demo's console: library output (Python's and what child processes write to the inherited
descriptors) goes to the log file, and only what the demo says reaches the terminal."""
import os
import subprocess
import sys

from rollout_cluster.demo import append_ray_logs, output_to, stderr_to


def test_output_to_sends_fds_and_children_to_the_log_and_keeps_a_console(tmp_path, capfd):
    log = tmp_path / "demo.log"
    with output_to(log) as console:
        print("from python stdout")
        print("from python stderr", file=sys.stderr)
        os.write(2, b"from fd 2\n")
        subprocess.run([sys.executable, "-c", "import sys; print('from a child'); print('child err', file=sys.stderr)"])
        with stderr_to(console):
            print("progress bar", file=sys.stderr)
        print("summary line", file=console)
    text = log.read_text()
    for line in ("from python stdout", "from python stderr", "from fd 2", "from a child", "child err"):
        assert line in text
    out, err = capfd.readouterr()
    assert "progress bar" in err and "summary line" in err
    assert "from a child" not in out + err and "from fd 2" not in err


def test_append_ray_logs_copies_worker_and_serve_logs_with_headers(tmp_path):
    logs = tmp_path / "session" / "logs"
    (logs / "serve").mkdir(parents=True)
    (logs / "worker-1.out").write_text("INFO vllm engine up\n")
    (logs / "worker-1.err").write_text("")
    (logs / "serve" / "replica_rollout.log").write_text("replica pulled\n")
    (logs / "raylet.out").write_text("not copied\n")
    out = tmp_path / "demo.log"
    append_ray_logs(str(tmp_path / "session"), out)
    text = out.read_text()
    assert "===== worker-1.out =====\nINFO vllm engine up" in text
    assert "===== serve/replica_rollout.log =====\nreplica pulled" in text
    assert "worker-1.err" not in text and "not copied" not in text
