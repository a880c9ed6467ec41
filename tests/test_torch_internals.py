"""torch's private APIs go through one module, and what we rely on is still there.

* Every private torch import and private attribute of a torch module is in
  ``sac_compile/torch_internals.py``; every frame peek and rebinding of a torch attribute in
  ``sac_compile/torch_patches.py`` (an ``ast`` walk over the package, function-local code
  included). Names are followed through aliases of torch modules; attributes of torch
  *values* (``op._schema``, ``t._version``) are not: the walk cannot know a value's type.
* Every private name ``torch_internals`` offers resolves on this torch, or says which torch
  it needs; importing it imports no module ``import torch`` had not.
* Each peek and the ``warning_once`` rebinding still finds what it looks for in torch's
  code, on a torch they were written against (``torch_patches.WRITTEN_AGAINST``).
"""
from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sac_compile import torch_internals, torch_patches

PACKAGE = Path(__file__).resolve().parent.parent / "sac_compile"
INTERNALS = {"torch_internals.py"}
PATCHES = {"torch_patches.py"}
# Frame and traceback attributes: reading them is a peek at someone's frame.
FRAME_ATTRS = {"f_locals", "f_back", "f_globals", "tb_frame", "gi_frame"}
FRAME_CALLS = {"sys._getframe", "inspect.currentframe", "inspect.stack", "inspect.trace",
               "sys._current_frames"}


def _private(parts: list[str]) -> bool:
    return any((p.startswith("_") and not (p.startswith("__") and p.endswith("__")))
               or p == "__version__" for p in parts[1:])


def _chain(node: ast.AST) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def torch_uses(path: Path) -> tuple[list[str], list[str]]:
    """(private torch uses, frame peeks and torch rebindings) of one file, as
    ``"line: text"``. Names bound to torch modules (``import torch.utils.checkpoint as
    tuc``, ``from torch import nn``) are followed: ``tuc._VersionWrapper`` counts."""
    tree = ast.parse(path.read_text())
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            child.parent = parent  # type: ignore[attr-defined]
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    aliases[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and \
                node.module.split(".")[0] == "torch":
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    # Names that stand for torch objects handed out by torch_internals: assigning to one of
    # their attributes rebinds torch's code as much as ``torch.x.y = ...`` does.
    from_internals = {a.asname or a.name for node in ast.walk(tree)
                      if isinstance(node, ast.ImportFrom) and node.module is not None
                      and node.module.endswith("torch_internals") for a in node.names}
    from_internals |= {"torch_internals"}
    private: list[str] = []
    peeks: list[str] = []
    for node in ast.walk(tree):
        where = f"{getattr(node, 'lineno', '?')}: "
        if isinstance(node, ast.Import):
            private += [where + f"import {a.name}" for a in node.names
                        if a.name.split(".")[0] == "torch" and _private(a.name.split("."))]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and \
                node.module.split(".")[0] == "torch":
            private += [where + f"from {node.module} import {a.name}" for a in node.names
                        if _private([*node.module.split("."), a.name])]
        elif isinstance(node, ast.Attribute):
            if node.attr in FRAME_ATTRS:
                peeks.append(where + f".{node.attr}")
            if isinstance(node.parent, ast.Attribute):
                continue  # the outermost attribute of a chain counts, once
            chain = _chain(node)
            if chain and chain[0] in aliases:
                full = aliases[chain[0]].split(".") + chain[1:]
                if _private(full):
                    private.append(where + ".".join(full))
            if chain and isinstance(node.ctx, ast.Store) and \
                    (chain[0] in aliases or chain[0] in from_internals):
                peeks.append(where + "assigns " + ".".join(chain))
        elif isinstance(node, ast.Call):
            chain = _chain(node.func)
            name = ".".join(chain) if chain else ""
            if name in FRAME_CALLS:
                peeks.append(where + name)
            if name == "setattr" and node.args and (_chain(node.args[0]) or [""])[0] in \
                    {*aliases, *from_internals}:
                peeks.append(where + "setattr " + ".".join(_chain(node.args[0]) or []))
            if name in ("getattr", "hasattr", "setattr") and len(node.args) >= 2 and \
                    isinstance(node.args[1], ast.Constant) and \
                    str(node.args[1].value).startswith("_"):
                target = _chain(node.args[0])
                if target and target[0] in aliases:
                    private.append(where + f"{name}({'.'.join(target)}, "
                                           f"{node.args[1].value!r})")
    return private, peeks


def _scan() -> dict[str, tuple[list[str], list[str]]]:
    return {str(p.relative_to(PACKAGE)): torch_uses(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_private_torch_apis_are_used_only_through_torch_internals():
    found = {f: private for f, (private, _) in _scan().items()
             if private and f not in INTERNALS}
    assert found == {}, "import these through sac_compile.torch_internals (a stable name " \
                        "there, with what it is for and the torch versions verified)"


def test_frame_peeks_and_torch_rebindings_only_in_torch_patches():
    found = {f: peeks for f, (_, peeks) in _scan().items() if peeks and f not in PATCHES}
    assert found == {}, "frame peeks and rebinding torch's functions belong in " \
                        "sac_compile.torch_patches, with the torch versions written against"


def test_the_walk_finds_what_it_looks_for():
    """The walk is not vacuous: the two quarantined modules are where the uses are."""
    scan = _scan()
    assert len(scan["torch_internals.py"][0]) >= 10
    assert len(scan["torch_patches.py"][1]) >= 5


def test_every_lazy_name_resolves_or_names_the_torch_it_needs():
    version = torch.torch_version.TorchVersion(torch.__version__)
    for name, entry in torch_internals._LAZY.items():
        try:
            assert getattr(torch_internals, name) is not None, name
        except torch_internals.TorchAPIMissing as e:
            assert version < entry.needs, f"{name}: this torch should have it: {e}"
            assert f"torch >= {entry.needs}" in str(e), str(e)


def test_a_missing_api_is_named_at_use_with_the_torch_it_needs(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch._functorch.compile_utils", None)
    with pytest.raises(torch_internals.TorchAPIMissing,
                       match=r"torch\._functorch\.compile_utils\.fx_graph_cse .*"
                             r"needs torch >= 2\.11") as info:
        from sac_compile.torch_internals import fx_graph_cse  # noqa: F401
    assert info.value.where == "torch._functorch.compile_utils.fx_graph_cse"
    with pytest.raises(ImportError, match="no_such_name"):
        from sac_compile.torch_internals import no_such_name  # noqa: F401


def test_one_torch_api_missing_error():
    from sac_compile.compiler import offload
    assert offload.TorchAPIMissing is torch_internals.TorchAPIMissing


def test_importing_torch_internals_imports_nothing_heavy():
    """Bound at import: only modules ``import torch`` loads (the file loaded on its own: it
    imports nothing from the package). And ``import sac_compile`` loads none of the heavy
    modules the lazy names stand for (Inductor's compiler, the partitioners)."""
    path = PACKAGE / "torch_internals.py"
    code = ("import sys, importlib.util, torch; before = set(sys.modules); "
            f"spec = importlib.util.spec_from_file_location('ti', {str(path)!r}); "
            "spec.loader.exec_module(importlib.util.module_from_spec(spec)); "
            "print(sorted(m for m in set(sys.modules) - before if m.startswith('torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]", out
    heavy = ["torch._inductor.compile_fx", "torch._functorch.partitioners",
             "torch._inductor.pattern_matcher", "torch._inductor.decomposition",
             "torch._functorch._aot_autograd.graph_compile"]
    code = f"import sys, sac_compile; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]", out


def test_logging_internals_we_use_are_there():
    tl = torch_internals.torch_logging
    for attr in ("log_registry", "register_log", "register_artifact", "getArtifactLogger",
                 "log_state", "configure_artifact_log", "DEFAULT_FORMATTER"):
        assert hasattr(tl, attr), attr


def test_dynamo_still_keeps_the_context_fn_where_we_read_it():
    wrap = torch_internals.checkpoint_hop_module
    from sac_compile import graph_meta
    assert f'"{graph_meta.CHECKPOINT_CONTEXT_FN}"' in inspect.getsource(wrap)


def test_config_default_reads_torch_defaults():
    cfg = torch_internals.functorch_config
    assert torch_internals.config_default(cfg, "activation_memory_budget") == 1.0


# -- the quarantined peeks and rebinding --------------------------------------------------

def test_torch_is_one_the_patches_were_written_against():
    """A torch none was verified on: check each test below passes and what it guards still
    behaves (tests/test_compile_quiet.py, test_upstream_behaviours.py), then add it."""
    ours = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    assert ours in torch_patches.WRITTEN_AGAINST, \
        f"torch {torch.__version__}: re-verify sac_compile/torch_patches.py, then add it"


def test_aot_autograd_still_has_the_partition_fn_local():
    from torch._functorch.aot_autograd import aot_module_simplified
    assert aot_module_simplified.__code__.co_name == torch_patches.AOT_ENTRY
    assert torch_patches.AOT_PARTITION_FN in inspect.signature(aot_module_simplified).parameters


def test_partition_fn_on_stack_reads_the_frame():
    def aot_module_simplified(partition_fn):  # the frame the peek looks for
        return torch_patches.partition_fn_on_stack()
    marker = object()
    assert aot_module_simplified(marker) is marker
    assert torch_patches.partition_fn_on_stack() is None


def test_checkpoint_still_has_its_generator_local():
    checkpoint = torch.utils.checkpoint.checkpoint
    code = inspect.unwrap(checkpoint).__code__
    assert code.co_name == torch_patches.CHECKPOINT_FN
    assert inspect.unwrap(checkpoint).__module__ == torch_patches.CHECKPOINT_MODULE
    assert torch_patches.CHECKPOINT_GENERATOR in code.co_varnames


def test_warning_once_is_still_the_global_tag_activation_checkpoint_calls():
    import sac_compile.compiler.regions_compiled  # noqa: F401  (rebinds at import)
    wrap = torch_internals.checkpoint_hop_module
    current = wrap.warning_once
    assert getattr(current, "_sac_compile_quiet", False), "the rebinding did not happen"
    original = inspect.unwrap(current)
    params = list(inspect.signature(original).parameters.values())
    assert params[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    source = " ".join(inspect.getsource(wrap).split())
    assert torch_patches.CONTEXT_FN_WARNING in source
    callers = [c for c in vars(wrap).values() if inspect.isfunction(c)
               and c.__module__ == wrap.__name__ and "warning_once" in c.__code__.co_names]
    assert callers, "no function of torch._higher_order_ops.wrap calls warning_once"
    for fn in callers:
        names = set(fn.__code__.co_varnames)
        assert names & set(torch_patches.CONTEXT_FN_CALLER_LOCALS), fn.__name__


def test_the_rebinding_skips_only_our_context_fns(monkeypatch):
    wrap = torch_internals.checkpoint_hop_module
    seen: list[str] = []
    monkeypatch.setattr(wrap, "warning_once", lambda logger, msg, *a, **k: seen.append(msg))
    mine, theirs = object(), object()
    torch_patches.quiet_context_fn_warning(lambda fn: fn is mine)
    assert getattr(wrap.warning_once, "_sac_compile_quiet", False)

    def call(context_fn):  # stands for tag_activation_checkpoint_impl
        wrap.warning_once(None, torch_patches.CONTEXT_FN_WARNING + " under torch.compile")

    call(mine)
    call(theirs)
    wrap.warning_once(None, "another warning")
    assert len(seen) == 2 and seen[1] == "another warning", seen
