"""The GRPO example's command line (examples/grpo/train.py): values under which GRPO cannot learn,
or that would crash after the first rollout, are refused at once, naming the flag and its value."""
import pytest


def _grpo_train():
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().parent.parent / "examples" / "grpo" / "train.py"
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("grpo_train_review", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("flag,value,said", [
    ("--n", "1", "--n=1"), ("--updates", "0", "--updates=0"), ("--prompts", "0", "--prompts=0"),
    ("--steps", "0", "--steps=0"), ("--finish-fraction", "0", "--finish-fraction=0.0"),
    ("--finish-fraction", "1.5", "--finish-fraction=1.5"), ("--lr", "-1", "--lr=-1.0"),
    ("--min-digits", "9", "--min-digits=9")])
def test_grpo_refuses_a_value_it_cannot_learn_with_by_name(capsys, tmp_path, flag, value, said):
    """GRPO's advantage is relative to the prompt's group: with --n 1 group_advantages gives 0 to
    every sample, so the loss is 0 and the policy never changes, for as many steps as asked, with
    no word said. The example must refuse it, naming the field and its value."""
    train = _grpo_train()
    with pytest.raises((SystemExit, ValueError)) as e:
        train.parse_args(["--out", str(tmp_path), flag, value])
    err = str(e.value) + capsys.readouterr().err
    assert said in err, err


def test_grpo_takes_its_defaults_and_a_group_of_two(tmp_path):
    args = _grpo_train().parse_args(["--out", str(tmp_path), "--n", "2"])
    assert args.n == 2 and args.updates == 2 and 0 < args.finish_fraction <= 1
