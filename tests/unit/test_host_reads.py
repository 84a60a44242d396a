"""The host reads no tensor value in a quiet training step: titanlite's own code reads the losses and
gradient norms only on logging steps (titanlite/engine/trainer.py), and count_host_reads, the instrument that
shows it, counts what it should."""

import json
import subprocess
import sys

import torch

from tests.helpers import REPO, TINY, env, last_wins
from titanlite.tools.host_reads import count_host_reads

# A training worker in its own process (the trainer installs SIGTERM/SIGINT handlers): every host read
# made directly from titanlite's code (its data pipeline and tools aside), with a marker as each step
# starts, written in order to the JSON file named by argv[1]; argv[2:] are the run's arguments.
WORKER = r"""
import json, os, sys
os.environ["TITANLITE_DEVICE"] = "cpu"
import titanlite, titanlite.commands.train, titanlite.engine.trainer
from titanlite.tools.host_reads import count_host_reads

root = os.path.dirname(os.path.abspath(titanlite.__file__)) + os.sep
left_out = (root + "data" + os.sep, root + "tools" + os.sep)

def where(filename):
    filename = os.path.abspath(filename)
    return filename.startswith(root) and not filename.startswith(left_out)

markers = []  # (step, number of reads before it started)
reads = None
train_step = titanlite.engine.trainer.Trainer.train_step

def marked_train_step(self, *args, **kwargs):
    markers.append((self.step + 1, len(reads.calls)))
    return train_step(self, *args, **kwargs)

titanlite.engine.trainer.Trainer.train_step = marked_train_step
with count_host_reads(where) as reads:
    code = titanlite.commands.train.main(sys.argv[2:])
events, taken = [], 0
for step, before in markers:
    events += [["read", *call] for call in reads.calls[taken:before]]
    events.append(["step", step])
    taken = before
events += [["read", *call] for call in reads.calls[taken:]]
with open(sys.argv[1], "w") as f:
    json.dump({"code": code, "events": events}, f)
import torch.distributed as dist
if dist.is_initialized():
    dist.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
"""


def reads_by_step(events: list) -> dict[int, list[tuple]]:
    """Each read under the step it happened in (0: set-up, before step 1): the reads after step k's marker
    and before step k + 1's belong to step k."""
    by_step: dict[int, list[tuple]] = {}
    step = 0
    for event in events:
        if event[0] == "step":
            step = event[1]
        else:
            by_step.setdefault(step, []).append(tuple(event[1:]))
    return by_step


def test_quiet_steps_read_nothing_from_the_device(tmp_path):
    out = tmp_path / "events.json"
    args = [
        *TINY,
        "--training.steps",
        "40",
        "--metrics.log_freq",
        "20",
        "--training.local_batch_size",
        "2",
        "--job.dump_folder",
        str(tmp_path),
        "--job.name",
        "run",
    ]
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, str(out), *last_wins(args)],
        cwd=REPO,
        env=env(TITANLITE_DEVICE="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and out.exists(), (
        f"run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    events = json.loads(out.read_text())["events"]
    assert [e[1] for e in events if e[0] == "step"] == list(range(1, 41))
    by_step = reads_by_step(events)
    quiet = {step: calls for step, calls in by_step.items() if step not in (0, 20, 40)}
    assert not quiet, "host reads in quiet steps (step: [(method, file, line)]):\n" + "\n".join(
        f"  step {step}: {calls}" for step, calls in sorted(quiet.items())
    )
    # The logging steps do read (the losses and grad norms since the last log): the instrument sees them.
    assert by_step.get(20) and by_step.get(40), f"no host read on the logging steps 20 and 40: {by_step}"


def test_count_host_reads_counts_each_way_of_reading_and_restores_the_methods():
    originals = {
        name: getattr(torch.Tensor, name)
        for name in ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")
    }
    t = torch.tensor(3.0)
    with count_host_reads(lambda f: f == __file__) as reads:
        line = sys._getframe().f_lineno + 1
        values = [t.item(), float(t), int(t), bool(t), t.tolist(), t.cpu(), t.numpy()]
        torch.ones(3).sum()  # no read
    assert [m for m, _, _ in reads.calls] == ["item", "__float__", "__int__", "__bool__", "tolist", "cpu", "numpy"], (
        reads.calls
    )
    assert len(reads) == 7
    assert all(f == __file__ and n == line for _, f, n in reads.calls), reads.calls
    assert values[:5] == [3.0, 3.0, 3, True, 3.0]
    assert {name: getattr(torch.Tensor, name) for name in originals} == originals
    with count_host_reads(lambda f: f == __file__) as reads:
        pass
    t.item()  # outside the block: not counted
    assert len(reads) == 0
