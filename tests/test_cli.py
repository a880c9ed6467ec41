"""``python -m sac_compile``: report end to end, explain, bad input, logging."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from sac_compile.cli import main
from sac_compile.cli.args import UsageError, parse_budget
from sac_compile._bench.runner import GRAD_RTOL, STRATEGIES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _run(*args: str, env: dict | None = None, timeout: int = 170) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    full_env.pop("TORCH_LOGS", None)
    return subprocess.run([sys.executable, "-m", "sac_compile", *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


# --------------------------------------------------------------------------------------
# report, end to end (one subprocess: the compiled strategies run Inductor)
# --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def report_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    proc = _run("report", "--model", "mlp", "--size", "test", "--steps", "1", "--out", str(out))
    return proc, out


def test_report_exits_cleanly_and_prints_every_row(report_run):
    proc, _ = report_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    for _, label, _ in STRATEGIES:
        assert label.split(" (")[0].split(",")[0] in proc.stdout, label
    assert "Traceback" not in proc.stderr
    # The main job's output is ours alone: torch's "context_fn is passed to
    # torch.utils.checkpoint under torch.compile" warning stays out of it.
    assert "context_fn is passed" not in proc.stdout + proc.stderr
    # Compile steps say what they are doing.
    assert "compiling torch SAC compiled" in proc.stderr
    assert "compiling ours compiled" in proc.stderr


def test_report_json_has_every_strategy_and_matching_gradients(report_run):
    _, out = report_run
    doc = json.loads((out / "report.json").read_text())
    rows = {r["key"]: r for r in doc["strategies"]}
    assert list(rows) == [k for k, _, _ in STRATEGIES]
    for key, row in rows.items():
        assert row["status"] == "ok", row
        assert row["grad_diff"] is not None and row["grad_rel"] <= GRAD_RTOL, row
        assert row["kept_bytes"] > 0 and row["peak_bytes"] > 0
        assert row["time_ratio"] > 0 and row["rounds"] == 1
        assert row["recompute_flops"] >= 0
    assert rows["no_ac"]["grad_diff"] == 0.0 and rows["no_ac"]["recompute_flops"] == 0
    # The eager strategies that recompute keep fewer bytes than no AC.
    for key in ("full_ac", "torch_sac_eager", "ours_eager", "ours_compiled", "ours_budget"):
        assert rows[key]["kept_bytes"] < rows["no_ac"]["kept_bytes"], key
    # The budget row (default 0.5) keeps less than ours without a budget.
    assert rows["ours_budget"]["kept_bytes"] < rows["ours_compiled"]["kept_bytes"]
    assert rows["full_ac"]["recompute_flops"] > 0
    meta = doc["meta"]
    assert meta["model"] == "mlp" and meta["size"] == "test" and meta["torch"] == torch.__version__
    assert meta["machine"] and meta["date"] and "CPU" in meta["definitions"]["peak_bytes"]
    # The peak column is measured for every row (the allocator's bytes, gradients included:
    # each step leaves the same gradients); the model stays beside it on compiled rows.
    grads = {row["grad_bytes"] for row in rows.values()}
    assert len(grads) == 1 and grads.pop() > 0
    for row in rows.values():
        assert row["peak_bytes"] > row["grad_bytes"]
        assert 0 < row["working_bytes"] <= row["peak_bytes"]
        assert (row["model_peak_bytes"] is not None) == (row["kind"] == "compiled"), row
    assert "measured" in meta["definitions"]["peak_bytes"]


def test_report_png_is_a_valid_image(report_run):
    pytest.importorskip("matplotlib", reason="report.png needs the report extra (matplotlib)")
    _, out = report_run
    png = out / "report.png"
    data = png.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.image as mpimg
    img = mpimg.imread(str(png))
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 200
    assert img.std() > 0.01       # not a blank canvas


# --------------------------------------------------------------------------------------
# Bad input: one line, the fix, exit code 2, no traceback
# --------------------------------------------------------------------------------------

def _bad(capsys, *argv: str) -> str:
    rc = main(list(argv))
    captured = capsys.readouterr()
    assert rc == 2, (rc, captured.err)
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    return lines[0]


def test_unknown_model(capsys):
    msg = _bad(capsys, "report", "--model", "resnet")
    assert "unknown model 'resnet'" in msg and "mlp, gpt, conv, moe" in msg


@pytest.fixture
def factory_file(tmp_path):
    path = tmp_path / "user_models.py"
    path.write_text(textwrap.dedent("""
        import torch

        def only_model():
            return torch.nn.Linear(4, 4)

        def three_things():
            return torch.nn.Linear(4, 4), (torch.randn(2, 4),), "extra"

        def no_tensor_inputs():
            return torch.nn.Linear(4, 4), ("not a tensor",)

        def good():
            return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(),
                                       torch.nn.Linear(8, 4)), (torch.randn(2, 4),)
    """))
    return path


@pytest.mark.parametrize("fn, expect", [
    ("only_model", "returned a Linear"),
    ("three_things", "returned a tuple of length 3"),
    ("no_tensor_inputs", "example_inputs hold no tensor"),
    ("missing", "has no attribute 'missing'"),
])
def test_factory_with_the_wrong_shape(capsys, factory_file, fn, expect):
    msg = _bad(capsys, "report", "--model", f"{factory_file}:{fn}")
    assert expect in msg
    assert "(model, example_inputs)" in msg or "check the name" in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda(capsys):
    msg = _bad(capsys, "report", "--device", "cuda")
    assert "CUDA is not available" in msg and "--device cpu" in msg


@pytest.mark.parametrize("budget", ["0", "-0.5", "1.5", "abc", "12parsecs", "0.3KiB"])
def test_budget_outside_unit_interval_and_not_bytes(capsys, budget):
    msg = _bad(capsys, "report", "--budget", budget)
    assert "--budget" in msg and "(0, 1]" in msg


def test_budget_forms():
    # One meaning, as memory_budget in Python: a float in (0, 1] is a fraction, an int >= 2
    # (or a number with a unit) is bytes; "1" is ambiguous and refused with the fix.
    assert parse_budget("0.5") == 0.5 and parse_budget("1.0") == 1.0
    assert isinstance(parse_budget("1.0"), float)
    assert parse_budget("65536") == 65536 and isinstance(parse_budget("65536"), int)
    assert parse_budget("64MiB") == 64 * 2**20 and parse_budget("2k") == 2000
    with pytest.raises(UsageError, match=r"did you mean 1.0 \(100%\) or 1 byte\?"):
        parse_budget("1")
    with pytest.raises(UsageError, match="a float is a fraction"):
        parse_budget("2.5")
    with pytest.raises(UsageError, match=r"--budget=-0.5: a fraction must lie in \(0, 1\]"):
        parse_budget("-0.5")
    for bad in ("0", "0.0", "-3", "inf", "nan", "half", "3 parsecs"):
        with pytest.raises(UsageError, match="--budget"):
            parse_budget(bad)
    # peak:X is a PeakBudget (the step's peak), in the same forms
    from sac_compile import PeakBudget
    assert parse_budget("peak:64MiB") == PeakBudget(64 * 2**20)
    assert parse_budget("PEAK:0.8") == PeakBudget(0.8)
    for bad in ("peak:1", "peak:", "peak:lots"):
        with pytest.raises(UsageError, match="--budget peak:"):
            parse_budget(bad)


def test_unknown_policy(capsys):
    msg = _bad(capsys, "report", "--policy", "save_everything")
    assert "unknown policy 'save_everything'" in msg and "save_matmuls" in msg


def test_debug_shows_the_traceback():
    with pytest.raises(UsageError):
        main(["report", "--model", "resnet", "--debug"])


def test_exit_code_and_single_line_from_the_module_entry_point():
    proc = _run("report", "--model", "nope")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr


def test_help_explains_every_flag():
    proc = _run("report", "--help")
    assert proc.returncode == 0
    for flag in ("--model", "--policy", "--budget", "--device", "--steps", "--out", "--debug",
                 "--size", "--seed"):
        assert flag in proc.stdout, flag
    assert "strategies" in proc.stdout and "peak" in proc.stdout


# --------------------------------------------------------------------------------------
# explain, and a user's factory through report (eager only, fast)
# --------------------------------------------------------------------------------------

def test_explain_prints_both_modes_and_the_diff(capsys):
    assert main(["explain", "mlp"]) == 0
    out = capsys.readouterr().out
    assert "PartitionReport (eager)" in out and "PartitionReport (compile)" in out
    # The compiler overrides PREFER_RECOMPUTE on the residual adds of the MLP: there are
    # differences, and they are listed op by op.
    assert "differences (eager vs compile):" in out and "no differences" not in out
    assert "saved aten.add.Tensor: eager x0, compile x2" in out
    assert "MUST_SAVE" in out


def test_report_with_a_user_factory_no_compile(capsys, factory_file, tmp_path):
    rc = main(["report", "--model", f"{factory_file}:good", "--no-compile", "--no-plot",
               "--steps", "1", "--out", str(tmp_path)])
    assert rc == 0, capsys.readouterr().err
    doc = json.loads((tmp_path / "report.json").read_text())
    rows = {r["key"]: r for r in doc["strategies"]}
    assert rows["ours_compiled"]["status"] == "skipped"
    assert rows["ours_eager"]["status"] == "ok" and rows["ours_eager"]["grad_diff"] == 0.0
    assert doc["meta"]["blocks"] == 1     # no .blocks: the whole model is one region


_STACK = textwrap.dedent("""
    import torch

    class Stack(torch.nn.Module):
        # four MLP blocks at batch 512: activations (512 KiB per hidden layer) dominate the
        # step, parameters (128 KiB per block) do not
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                    torch.nn.Linear(256, 64)) for _ in range(4))

        def forward(self, x):
            for b in self.blocks:
                x = x + b(x)
            return x

    def stack():
        torch.manual_seed(0)
        return Stack(), (torch.randn(512, 64),)
""")


def test_report_eager_peak_budget_row_holds_the_measured_peak(tmp_path):
    """``--budget peak:N`` in eager mode: the eager budget row is ``apply_regions(...,
    memory_budget=PeakBudget(N))`` after its calibration steps, its measured step peak at
    most N (between full AC's and no AC's), keeping less and recomputing more than the
    row without a budget, with no AC's gradients; a fraction is compiled only (skipped,
    saying so)."""
    (tmp_path / "stack_model.py").write_text(_STACK)
    model = f"{tmp_path / 'stack_model.py'}:stack"

    def rows(budget: str) -> dict:
        out = tmp_path / budget.replace(":", "_")
        rc = main(["report", "--model", model, "--no-compile", "--no-plot", "--steps", "1",
                   "--budget", budget, "--out", str(out)])
        assert rc == 0
        return {r["key"]: r for r in json.loads((out / "report.json").read_text())["strategies"]}

    free = rows("peak:0.5")
    assert free["ours_eager_budget"]["status"] == "skipped"
    assert "a fraction is compiled only" in free["ours_eager_budget"]["note"]
    top, low = free["ours_eager"]["peak_bytes"], free["full_ac"]["peak_bytes"]
    assert low < top
    n = (low + top) // 2
    got = rows(f"peak:{n}")
    row, unbudgeted = got["ours_eager_budget"], got["ours_eager"]
    assert row["status"] == "ok", row
    assert row["peak_bytes"] <= n
    assert row["kept_bytes"] < unbudgeted["kept_bytes"]
    assert row["recompute_flops"] > unbudgeted["recompute_flops"]
    assert row["grad_rel"] <= GRAD_RTOL
    assert "measured steps" in row["note"]


# --------------------------------------------------------------------------------------
# Logging: silent by default; the switch prints
# --------------------------------------------------------------------------------------

def test_library_is_silent_by_default():
    code = ("import torch, sac_compile, sac_compile.logs\n"
            "from sac_compile import sac_region\n"
            "f = sac_region('save_matmuls')(lambda x: (x @ x).sin())\n"
            "f(torch.randn(4, 4, requires_grad=True)).sum().backward()\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "TORCH_LOGS"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""


def test_env_switch_enables_logger_and_artifact():
    code = ("import logging, sac_compile.logs as L\n"
            "logging.getLogger('sac_compile.runtime').debug('hello-debug')\n"
            "L.partition_log.debug('hello-artifact')\n")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS"}
    quiet = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                           text=True, env=env)
    assert quiet.stderr == ""
    loud = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**env, "SAC_COMPILE_LOGS": "+sac_compile,sac_partition"})
    assert "hello-debug" in loud.stderr and "hello-artifact" in loud.stderr
    only_artifact = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                                   text=True, env={**env, "SAC_COMPILE_LOGS": "sac_partition"})
    assert "hello-artifact" in only_artifact.stderr and "hello-debug" not in only_artifact.stderr


def test_a_model_with_nothing_to_differentiate_is_a_usage_error(capsys, tmp_path):
    path = tmp_path / "frozen.py"
    path.write_text("import torch\n\ndef frozen():\n"
                    "    return torch.nn.Linear(4, 4).requires_grad_(False), (torch.randn(2, 4),)\n")
    msg = _bad(capsys, "report", "--model", f"{path}:frozen", "--no-compile", "--steps", "1",
               "--out", str(tmp_path / "out"))
    assert "no parameter or input requires grad" in msg and "requires_grad_(False)" in msg


# --------------------------------------------------------------------------------------
# Hugging Face models: hf:NAME from a small config, a user's factory; eager/aot_eager only
# --------------------------------------------------------------------------------------

def _needs_transformers():
    pytest.importorskip("transformers", minversion="4.40",
                        reason="Hugging Face transformers is not installed "
                               "(pip install -e '.[integrations]')")


@pytest.mark.parametrize("name, blocks", [("hf:gpt2", 2), ("hf:llama", 2)])
def test_report_hf_model_no_compile(capsys, tmp_path, name, blocks):
    _needs_transformers()
    rc = main(["report", "--model", name, "--no-compile", "--no-plot", "--steps", "1",
               "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert f"model {name} (test)" in captured.out and "ours eager (save_matmuls)" in captured.out
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["meta"]["model"] == name and doc["meta"]["blocks"] == blocks  # one per layer
    assert doc["meta"]["inputs"] == [[2, 16]]                                # input_ids
    rows = {r["key"]: r for r in doc["strategies"]}
    for key in ("no_ac", "full_ac", "torch_sac_eager", "ours_eager"):
        assert rows[key]["status"] == "ok" and rows[key]["grad_diff"] == 0.0, rows[key]
    assert rows["ours_compiled"]["status"] == "skipped"
    # The regions save no more than torch's SAC with the same op list, less than no AC.
    assert rows["ours_eager"]["kept_bytes"] <= rows["torch_sac_eager"]["kept_bytes"] \
        < rows["no_ac"]["kept_bytes"]


def test_explain_hf_model_eager_and_aot_eager(capsys):
    _needs_transformers()
    assert main(["explain", "hf:llama"]) == 0
    out = capsys.readouterr().out
    assert "hf:llama: every block in sac_region('save_matmuls')" in out
    assert "PartitionReport (eager)" in out and "PartitionReport (compile)" in out
    assert "blocks.0" in out and "blocks.1" in out     # one region per decoder layer


def test_hf_model_without_transformers_says_how_to_install(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    msg = _bad(capsys, "report", "--model", "hf:gpt2")
    assert "needs Hugging Face transformers" in msg
    assert "pip install 'sac_compile[integrations]'" in msg


def test_unknown_hf_model(capsys):
    msg = _bad(capsys, "report", "--model", "hf:bert")
    assert "unknown Hugging Face model 'bert'" in msg and "hf:gpt2, hf:llama" in msg
    msg = _bad(capsys, "report", "--model", "hf:llama", "--size", "huge")
    assert "unknown size 'huge' for hf:llama" in msg


def test_report_user_factory_returning_an_hf_model(capsys, tmp_path):
    """The MODULE:FUNCTION recipe with a user's own HF model: its decoder layers become the
    blocks, HF's loss on labels=input_ids the output."""
    _needs_transformers()
    path = tmp_path / "my_hf.py"
    path.write_text(textwrap.dedent("""
        import torch
        import transformers

        def build():
            cfg = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=32,
                                           intermediate_size=64, num_attention_heads=4,
                                           num_key_value_heads=2, vocab_size=64,
                                           max_position_embeddings=32, use_cache=False)
            model = transformers.LlamaForCausalLM(cfg).train()
            return model, (torch.randint(0, 64, (2, 8)),)
    """))
    rc = main(["report", "--model", f"{path}:build", "--no-compile", "--no-plot", "--steps",
               "1", "--out", str(tmp_path / "out")])
    assert rc == 0, capsys.readouterr().err
    doc = json.loads((tmp_path / "out" / "report.json").read_text())
    assert doc["meta"]["blocks"] == 3
    rows = {r["key"]: r for r in doc["strategies"]}
    assert rows["ours_eager"]["status"] == "ok" and rows["ours_eager"]["grad_diff"] == 0.0
