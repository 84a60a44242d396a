"""`titanlite COMMAND --help` (and `-h`) prints that command's own usage and exits 0, for every command USAGE lists,
with nothing on stderr and nothing run (the folder a command would write stays empty); a number an option cannot
take (NaN, infinity, below its least) is one line, exit 2."""

import pytest

from titanlite.commands import cli

# Every command of USAGE, and the sub-commands that have their own options.
COMMANDS = sorted({line.split()[0] for line in cli.USAGE.splitlines()[2:] if not line.startswith("    ")} - {"help"})
SUB_COMMANDS = [["bench", sub] for sub in cli.BENCHES] + [["convert", "to-hf"]]


def test_usage_lists_every_command_there_is():
    assert set(COMMANDS) == set(cli.COMMANDS) | {"train"}


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("words", [[c] for c in COMMANDS if c != "train"] + SUB_COMMANDS, ids=" ".join)
def test_every_command_prints_its_own_help(words, flag, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main([*words, flag]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.startswith(f"usage: titanlite {' '.join(words)}"), out[:200]
    assert list(tmp_path.iterdir()) == []  # nothing ran: no run folder, store or output


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["generate", "--prompt", "hi", "--temperature", "nan"],
            "generate --temperature takes a finite number, not 'nan'",
        ),
        (
            ["generate", "--prompt", "hi", "--temperature=-inf"],
            "generate --temperature takes a finite number, not '-inf'",
        ),
        (["plan", "--gpu-tflops", "inf"], "plan: --gpu-tflops takes a finite number, not 'inf'"),
        (["plan", "--gpu-tflops", "0"], "--gpu-mem-gib and --gpu-tflops > 0"),
        (["plan", "--gpu-mem-gib", "nan"], "plan: --gpu-mem-gib takes a finite number, not 'nan'"),
        (["compare", "a", "b", "--max-diff", "inf"], "compare --max-diff takes a finite number, not 'inf'"),
        (["compare", "a", "b", "--max-diff", "-0.5"], "compare --max-diff must be at least 0, not -0.5"),
        (["eval", "--output", "."], "eval --output . is a folder; name a file"),  # checked before evaluating
        (["eval", "--output", "/etc/passwd/eval.json"], "is under /etc/passwd, which is a file, not a folder"),
        (["generate", "--prompt", "hi", "--output", "."], "generate --output . is a folder; name a file"),
        (["eval", "--output", "/proc/eval.json"], "is under /proc, on the kernel's proc file system; name a path on"),
        (["convert", "to-hf", "--output", "/proc/self/hf"], "cannot write in /proc/self; name a path in a folder"),
    ],
)
def test_a_number_that_makes_no_sense_is_one_line_before_anything_runs(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("titanlite: error: "), err
    assert list(tmp_path.iterdir()) == []


LONG = "a" * 300  # a name no file system holds (255 bytes at most)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["trian"], "unknown command 'trian' (did you mean 'train'?); see titanlite --help"),
        (["bogus"], "unknown command 'bogus'; see titanlite --help"),
        (["check", "--nproc-per-node", "0"], "check --nproc-per-node must be at least 1, not 0"),
        (["check", "--world-size", "-2"], "check --world-size must be at least 1, not -2"),
        (
            ["check", "--world-size", "4", "--nproc-per-node", "3"],
            "check --nproc-per-node 3 does not divide --world-size 4",
        ),
        (
            ["check", "--world-size", "2", "--nproc-per-node", "4"],
            "check --nproc-per-node 4 is more than --world-size 2",
        ),
        (["prepare", "--workers", "-1"], "prepare --workers must be at least 0, not -1"),
        (["prepare", "--workers", "100000"], "prepare --workers 100000 is more than the"),
        (["generate", "--prompt", "a", "--prompt=b"], "generate --prompt is given twice ('a', then 'b'); give it once"),
        (["prepare", "--rebuild", "--rebuild"], "prepare --rebuild is given twice; give it once"),
        (
            ["plan", "--optimizer.lr", "1e-3", "--optimizer.lr", "2e-3"],
            "optimizer.lr is given twice on the command line ('1e-3', then '2e-3'); give it once",
        ),
        (["eval", "--output", f"{LONG}.json"], "eval --output: its name 'aaaaaaaaaaaaaaaaaaaaaaaa...' is 305 bytes"),
        (["generate", "--prompt", "a", "--output", f"x/{LONG}/g.json"], "generate --output: its name 'aaaa"),
        (["convert", "to-hf", "--output", f"/tmp/{LONG}"], "convert to-hf --output: its name 'aaaa"),
        (["bench", "throughput", "--output", f"{LONG}.json"], "bench throughput --output: its name 'aaaa"),
        (["bench", "data", "--output", f"{LONG}.json"], "bench data --output: its name 'aaaa"),
        (["bench", "strategies", "--output", LONG], "bench strategies --output: its name 'aaaa"),
        (["bench", "batch-sizes", "--output", LONG], "bench batch-sizes --output: its name 'aaaa"),
        (["compare", "a", "b", "--output", f"{LONG}.png"], "compare --output: its name 'aaaa"),
        (["compare", f"x/{LONG}", "b"], "compare RUN_DIR: its name 'aaaa"),
        (["analyze", f"x/{LONG}"], "analyze: its name 'aaaa"),
        (["bench", "data", "--keep", LONG], "bench data --keep: its name 'aaaa"),
    ],
)
def test_a_command_line_it_cannot_take_is_one_line_before_anything_runs(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("titanlite: error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert list(tmp_path.iterdir()) == []
