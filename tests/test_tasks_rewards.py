import logging
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.reward_functions import exact_match, gsm8k_match, load_reward_function
from tasks.rewards import RewardFunctionRunner
from tests import user_rewards

ROOT = Path(__file__).resolve().parent.parent
WORKER_NAME = "meshrl-reward-worker"


def live_workers() -> list:
    return [p for p in multiprocessing.active_children() if p.name == WORKER_NAME]


@pytest.mark.parametrize(
    "response, ground_truth, expected",
    [
        ("46", "46", 1.0),
        ("46", "47", 0.0),
        ("12+34=46", "46", 1.0),
        ("The total is $1,234.50.", "1234.5", 1.0),
        ("It costs 1,000 dollars", "1000", 1.0),
        ("3.0", "3", 1.0),
        ("She ends with -5 apples.", "-5", 1.0),
        ("The change is $-3", "-3", 1.0),
        ("The change is -$3", "-3", 1.0),
        ("She ends with 5 apples.", "-5", 0.0),
        ("#### 72, since 70 + 2 = 72 and 9 is unrelated", "72", 1.0),
        ("so 9 + 9 = 18\n#### 18", "18", 1.0),
        ("The answer is 72. Check: 72 - 70 = 2", "72", 0.0),
        ("The answer is 5 ####", "5", 1.0),
        ("no number here", "5", 0.0),
        ("so 18", "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs, 9 * 2 = 18.\n#### 18", 1.0),
        ("#### 1,234", "#### 1234", 1.0),
    ],
)
def test_gsm8k_match(response, ground_truth, expected):
    assert gsm8k_match(response, ground_truth) == expected
    assert gsm8k_match(response, ground_truth, "any prompt") == expected


def test_gsm8k_match_needs_a_numeric_ground_truth():
    with pytest.raises(ValueError, match="ground truth"):
        gsm8k_match("5", None)
    with pytest.raises(ValueError, match="'five'"):
        gsm8k_match("5", "five")


def test_exact_match():
    assert exact_match(" 46\n", "46") == 1.0
    assert exact_match("46", "460") == 0.0
    assert exact_match("Paris", " Paris ", "Capital of France?") == 1.0
    with pytest.raises(ValueError, match="ground truth"):
        exact_match("46", None)


def test_load_reward_function():
    assert load_reward_function("gsm8k") is gsm8k_match
    assert load_reward_function("exact_match") is exact_match
    assert load_reward_function("tests.user_rewards:char_count") is user_rewards.char_count


@pytest.mark.parametrize("spec", ["gsm8k_typo", "tests.user_rewards", ":char_count", "tests.user_rewards:", "a:b:c"])
def test_load_reward_function_malformed_spec(spec):
    with pytest.raises(ValueError, match="module.path:function") as error:
        load_reward_function(spec)
    assert repr(spec) in str(error.value)


def test_load_reward_function_missing_module_or_function():
    with pytest.raises(ValueError, match="cannot import module 'tests.no_such_module'"):
        load_reward_function("tests.no_such_module:f")
    with pytest.raises(ValueError, match="no function 'nope'") as error:
        load_reward_function("tests.user_rewards:nope")
    assert "char_count" in str(error.value)


def test_runner_builtin_runs_in_process():
    with RewardFunctionRunner("gsm8k") as runner:
        scores, stats = runner(["#### 46", "45", "x"], ["46", "46", "46"], ["12+34=", "12+34=", "12+34="])
        assert not live_workers()
    assert scores == [1.0, 0.0, 0.0]
    assert stats == {"reward_fn/errors": 0, "reward_fn/timeouts": 0}


def test_runner_user_function_in_workers():
    responses = [f"response {'x' * i}" for i in range(7)]
    with RewardFunctionRunner("tests.user_rewards:char_count", num_workers=2) as runner:
        assert len(live_workers()) == 2
        scores, stats = runner(responses, [None] * 7, ["p"] * 7)
        assert runner([], [], []) == ([], {"reward_fn/errors": 0, "reward_fn/timeouts": 0})
    assert scores == [float(len(r)) for r in responses]
    assert stats == {"reward_fn/errors": 0, "reward_fn/timeouts": 0}
    assert not live_workers()


def test_runner_counts_errors_and_logs_the_first_traceback_once(caplog):
    responses = ["raise one", "ok", "raise two", "exit", "fine"]
    expected = [0.0, 2.0, 0.0, 0.0, 4.0]
    # One worker scores the items in order, so the first failure is known.
    with (
        caplog.at_level(logging.ERROR, logger="meshrl"),
        RewardFunctionRunner("tests.user_rewards:raises_on_request", num_workers=1) as runner,
    ):
        scores, stats = runner(responses, [None] * 5, [""] * 5)
        assert scores == expected
        assert stats == {"reward_fn/errors": 3, "reward_fn/timeouts": 0}
        assert len(live_workers()) == 1  # the worker that exited was replaced

        scores, stats = runner(["abc", "raise three"], [None, None], ["", ""])
        assert scores == [3.0, 0.0]
        assert stats == {"reward_fn/errors": 1, "reward_fn/timeouts": 0}

    errors = [r for r in caplog.records if r.name == "meshrl" and r.levelno >= logging.ERROR]
    assert len(errors) == 1
    message = errors[0].getMessage()
    assert "tests.user_rewards:raises_on_request" in message
    assert "Traceback" in message
    assert "deliberate failure on 'raise one'" in message


@pytest.mark.parametrize("response, named", [("nan", "returned nan"), ("text", "'not a score' (str)")])
def test_runner_rejects_non_finite_and_non_numeric_scores(caplog, response, named):
    with (
        caplog.at_level(logging.ERROR, logger="meshrl"),
        RewardFunctionRunner("tests.user_rewards:raises_on_request", num_workers=1) as runner,
    ):
        scores, stats = runner([response], ["1"], ["p"])
    assert scores == [0.0]
    assert stats["reward_fn/errors"] == 1
    assert any(named in r.getMessage() for r in caplog.records)


def test_runner_kills_a_hung_worker_and_keeps_working(caplog):
    timeout_s = 1.0
    with (
        caplog.at_level(logging.WARNING, logger="meshrl"),
        RewardFunctionRunner("tests.user_rewards:hangs_on_request", num_workers=2, timeout_s=timeout_s) as runner,
    ):
        start = time.monotonic()
        scores, stats = runner(["hang", "ab", "abc", "abcd"], [None] * 4, [""] * 4)
        elapsed = time.monotonic() - start
        assert scores == [0.0, 2.0, 3.0, 4.0]
        assert stats == {"reward_fn/errors": 0, "reward_fn/timeouts": 1}
        assert timeout_s <= elapsed < timeout_s + 10
        assert len(live_workers()) == 2

        # Both workers hang at once; both are replaced and the next call is served normally.
        scores, stats = runner(["hang", "hang"], [None] * 2, [""] * 2)
        assert scores == [0.0, 0.0]
        assert stats == {"reward_fn/errors": 0, "reward_fn/timeouts": 2}
        scores, stats = runner(["xyz"], [None], [""])
        assert scores == [3.0]
        assert stats == {"reward_fn/errors": 0, "reward_fn/timeouts": 0}
    assert not live_workers()
    timeouts = [r for r in caplog.records if r.name == "meshrl" and "timeout_s" in r.getMessage()]
    assert len(timeouts) == 1


def test_runner_argument_errors():
    with RewardFunctionRunner("tests.user_rewards:nope") as missing:  # imported in the workers, not here
        with pytest.raises(ValueError, match="(?s)could not be loaded in its worker.*no function 'nope'"):
            missing(["a"], [None], [""])
    with pytest.raises(ValueError, match="num_workers=0"):
        RewardFunctionRunner("tests.user_rewards:char_count", num_workers=0)
    with pytest.raises(ValueError, match="timeout_s=0"):
        RewardFunctionRunner("tests.user_rewards:char_count", timeout_s=0)
    runner = RewardFunctionRunner("tests.user_rewards:char_count", num_workers=1)
    with pytest.raises(ValueError, match="2 responses, 1 ground truths, 2 prompts and 2 column sets"):
        runner(["a", "b"], [None], ["", ""])
    runner.close()
    runner.close()
    with pytest.raises(RuntimeError, match="closed"):
        runner(["a"], [None], [""])


def test_interpreter_exits_with_runner_left_open():
    script = (
        "from tasks.rewards import RewardFunctionRunner\n"
        "runner = RewardFunctionRunner('tests.user_rewards:hangs_on_request', timeout_s=0.5)\n"
        "print(runner(['hang', 'abc'], [None, None], ['', '']))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    assert "[0.0, 3.0]" in result.stdout


def test_the_three_conventions_get_their_arguments_and_the_data_columns():
    """meshrl's per-sample function, TRL's batched one (columns as keyword lists) and verl's compute_score (a dict's
    "score"), each in its own worker process."""
    with RewardFunctionRunner("tests.user_rewards:trl_style", num_workers=1) as trl:
        scores, _ = trl(["11", "12"], ["3", "4"], ["p", "q"], [{"bonus": 1}, {"bonus": 0}])
        assert scores == [1.0 + 10, 0.5] and trl.convention == "trl"
    with RewardFunctionRunner("tests.user_rewards:compute_score", num_workers=1) as verl:
        columns = [{"data_source": "a", "extra_info": {"weight": 0.25}}, {"data_source": "b", "extra_info":
                                                                           {"weight": 0.0}}]
        scores, _ = verl([" 7", "8"], ["7", "9"], ["p", "q"], columns)
        assert scores == [1.25, 0.0] and verl.convention == "verl"
    with RewardFunctionRunner("tests.user_rewards:char_count", num_workers=1) as ours:
        assert ours(["abc"], [None], ["p"])[0] == [3.0] and ours.convention == "meshrl"


def test_a_signature_of_no_convention_is_refused_naming_the_accepted_ones():
    with RewardFunctionRunner("tests.user_rewards:two_arguments", num_workers=1) as runner:
        with pytest.raises(ValueError, match=r"(?s)two_arguments\(completion, answer\).*TRL: f\(completions"):
            runner.check("3", "3", "p", {}, "record 1")


def test_a_module_that_hangs_on_import_cannot_hang_the_trainer(monkeypatch, tmp_path):
    """The module is imported in the workers only, under their start timeout."""
    import tasks.rewards as rewards

    (tmp_path / "slow_module.py").write_text("import time\ntime.sleep(3600)\ndef f(r, g, p):\n    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(rewards, "START_TIMEOUT_S", 3.0)
    began = time.monotonic()
    runner = RewardFunctionRunner("slow_module:f", num_workers=1)
    assert time.monotonic() - began < 2.0, "constructing the runner must not import the module"
    with pytest.raises(ValueError, match="did not start within 3.0 s"):
        runner.check("", None, "p", {}, "the first train record")


def test_a_syntax_error_in_the_module_names_the_file_and_line(monkeypatch, tmp_path):
    (tmp_path / "broken_module.py").write_text("def f(r, g, p):\n    return (\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with RewardFunctionRunner("broken_module:f", num_workers=1) as runner:
        with pytest.raises(ValueError, match=r"(?s)broken_module.py\", line 2.*SyntaxError"):
            runner.check("", None, "p", {}, "the first train record")


def test_a_busy_worker_dies_with_its_trainer(tmp_path):
    """SIGKILL of the process that owns a runner whose worker is inside a long call: the worker follows."""
    script = tmp_path / "owner.py"
    script.write_text(
        "import sys\n"
        f"sys.path[:0] = [{str(Path(__file__).resolve().parents[1])!r}]\n"
        "from tasks.rewards import RewardFunctionRunner\n"
        "if __name__ == '__main__':\n"
        "    r = RewardFunctionRunner('tests.user_rewards:hangs_on_request', num_workers=1, timeout_s=600)\n"
        "    print(r._workers[0].process.pid, flush=True)\n"
        "    r(['hang'], [None], [''])\n")
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    worker = int(owner.stdout.readline())
    time.sleep(3.0)  # the worker starts, loads the function and takes the hanging item
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{worker}").exists():
        time.sleep(0.2)
    assert not Path(f"/proc/{worker}").exists(), "the worker outlived its trainer"


def test_the_start_up_check_needs_a_finite_number():
    with RewardFunctionRunner("tests.user_rewards:text_score", num_workers=1) as runner:
        with pytest.raises(ValueError, match=r"(?s)failed its start-up call on record 1.*not a number"):
            runner.check("3", "3", "1+2=", {}, "record 1")
    with RewardFunctionRunner("tests.user_rewards:always_raises", num_workers=1) as runner:
        runner.check("3", "3", "1+2=", {}, "record 1")  # the ground truth as the response works
        scores, stats = runner(["3", "x", "y"], ["3", "3", "3"], ["p"] * 3)
        assert runner.last_failed == {1, 2} and stats["reward_fn/errors"] == 2 and "deliberate" in runner.last_error
    with pytest.raises(ValueError, match="needs a ground truth"):
        RewardFunctionRunner("exact_match").check("", None, "p", {}, "the first eval record")


def test_workers_do_not_run_the_main_script(tmp_path):
    """Spawn makes a child import its parent's main script (for train_ppo.py: torch, transformers, every role, seconds
    and hundreds of MB per worker); the workers skip it, unless the reward function lives there ("__main__:f").
    The main script here leaves a file behind each time it runs as a worker's __mp_main__."""
    script = tmp_path / "owner.py"
    marks = tmp_path / "marks"
    script.write_text(
        "import sys\n"
        f"sys.path[:0] = [{str(ROOT)!r}]\n"
        "OWNER_SCRIPT = True\n"
        "if __name__ == '__mp_main__':\n"
        f"    open({str(marks)!r}, 'a').write('ran\\n')\n"
        "from tasks.rewards import RewardFunctionRunner\n"
        "def here(response, ground_truth, prompt):\n"
        "    return 7.0\n"
        "if __name__ == '__main__':\n"
        "    with RewardFunctionRunner('tests.user_rewards:main_script_ran', num_workers=2) as r:\n"
        "        print(r(['a', 'b', 'c'], [None] * 3, [''] * 3)[0])\n"
        "    with RewardFunctionRunner('__main__:here', num_workers=1) as r:\n"
        "        print(r(['a'], [None], [''])[0])\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["[0.0, 0.0, 0.0]", "[7.0]"], result.stdout + result.stderr[-3000:]
    assert marks.read_text() == "ran\n", "only the worker of the '__main__:here' runner ran the script"
