"""The package's layers, checked on the import statements (lazy imports inside functions too).

Data flows one way (request -> scheduler -> KV cache manager -> model runner -> sampler -> output
processor -> client), and the imports follow it: a lower layer never imports a higher one, and no
two subpackages import each other, directly or around a circle.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "pagellm"

# What each unit may import from pagellm. The small top-level modules (config, request, ...) are
# the shared vocabulary of the layers above them; the tokenizer loads through the model loader.
SHARED = {"envs", "config", "sampling_params", "pooling_params", "request", "outputs", "speculative_config"}
ALLOWED: dict[str, set[str]] = {
    "envs": set(),
    "speculative_config": {"json_config"},
    "config": {"speculative_config", "pooling_params"},
    "sampling_params": set(),
    "json_config": set(),
    "pooling_params": {"json_config"},
    "outputs": set(),
    # LoRA: the adapter's identity (request.py) is vocabulary of the engine's layers; the rest of
    # the package (pools, PEFT loading) sits under the layers it adapts, on the kernels' grouped product.
    "lora": {"kernels", "envs"},
    "request": {"sampling_params", "pooling_params", "lora"},
    "tokenizer": {"models"},
    "kernels": {"envs"},
    "core": {"sampling_params", "pooling_params", "request", "speculative_config", "lora"},
    "attention": SHARED | {"kernels"},
    "sample": SHARED | {"kernels"},
    "layers": SHARED | {"kernels", "attention", "distributed", "lora"},
    "models": SHARED | {"kernels", "attention", "distributed", "layers", "lora"},
    # Reasoning parsers: text and token ids only; the engine finds the reasoning's bounds through them.
    "reasoning": set(),
    "structured_output": {"sampling_params", "reasoning"},
    "distributed": set(),
    # The offloading tier's storage and copies: torch, numpy and the standard library only.
    "kv_offload": set(),
    "worker": SHARED | {"kernels", "attention", "sample", "core", "structured_output", "distributed", "lora", "kv_offload"},
    # Speculative decoding's proposers: above the runner, whose batch they read.
    "spec_decode": SHARED | {"kernels", "attention", "sample", "models", "layers", "worker", "distributed", "lora"},
    # The resolved configuration: what the model, the machine and the user's config decide,
    # before anything loads; the executors' workers and the engine read it.
    "plan": SHARED | {"kernels", "attention", "models", "layers", "worker", "core", "distributed"},
    "executor": SHARED
    | {"kernels", "attention", "sample", "models", "layers", "worker", "core", "tokenizer", "structured_output", "distributed"}
    | {"spec_decode", "lora", "plan", "kv_offload"},
    "engine": SHARED
    | {"kernels", "attention", "sample", "models", "layers", "worker", "core", "tokenizer", "structured_output"}
    | {"distributed", "executor", "spec_decode", "lora", "plan", "reasoning", "kv_offload"},
    "entrypoints": SHARED | {"engine", "core", "cli", "tokenizer", "lora", "plan", "reasoning"},
    "bench": SHARED
    | {"kernels", "attention", "sample", "models", "layers", "worker", "core", "engine", "entrypoints", "cli", "tokenizer"}
    | {"structured_output", "distributed", "executor", "spec_decode", "lora", "plan", "reasoning", "kv_offload"},
}
# Subpackages that must not pull in torch: the scheduler and block pool are pure bookkeeping.
NO_TORCH = {"core"}


def unit_of(module: str) -> str:
    """pagellm.core.scheduler -> core; pagellm.config -> config."""
    return module.split(".")[1] if module.count(".") >= 1 else module


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, absolute names, wherever the import statement sits."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def module_graph() -> dict[str, set[str]]:
    """unit -> the pagellm units it imports (units: subpackages and top-level modules)."""
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        unit = unit_of(".".join(rel.parts))
        targets = graph.setdefault(unit, set())
        for name in imports_of(path):
            if name.startswith("pagellm.") and name != "pagellm.__init__":
                target = unit_of(name)
                if (ROOT / target).is_dir() or (ROOT / f"{target}.py").exists():
                    targets.add(target)
        targets.discard(unit)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph as a path (first node repeated at the end), or []."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def test_no_import_cycle_between_units():
    assert find_cycle(module_graph()) == []


@pytest.mark.parametrize("unit", sorted(ALLOWED))
def test_unit_imports_only_lower_layers(unit):
    graph = module_graph()
    assert graph.get(unit, set()) - ALLOWED[unit] == set()


def test_torch_free_units():
    for unit in NO_TORCH:
        for path in (ROOT / unit).rglob("*.py"):
            assert not any(n == "torch" or n.startswith("torch.") for n in imports_of(path)), path


def test_only_the_ops_module_calls_native_ops():
    callers = {
        p.relative_to(ROOT.parent).as_posix()
        for base in (ROOT, ROOT.parent / "tests", ROOT.parent / "scripts")
        for p in base.rglob("*.py")
        if "torch.ops.pagellm" in p.read_text(encoding="utf-8") and p.resolve() != Path(__file__).resolve()
    }
    assert callers <= {"pagellm/kernels/ops.py"}


def test_find_cycle_reports_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


# Inside entrypoints: what each part may import of the others. The shared pieces (the server's
# state and its one key check, the error bodies, the metrics) import none of them; the dashboard
# is not OpenAI API and never imports it; the OpenAI server attaches the dashboard's routes.
ENTRYPOINTS_ALLOWED: dict[str, set[str]] = {
    "server_state": set(),
    "errors": set(),
    "metrics": set(),
    "dashboard": {"server_state", "errors", "metrics"},
    "openai": {"server_state", "errors", "metrics", "dashboard"},
    "cli_generate": set(),
    "cli_chat": {"cli_generate"},
}


def test_entrypoints_parts_import_only_what_they_may():
    base = ROOT / "entrypoints"
    parts = {p.stem if p.is_file() else p.name for p in base.iterdir() if p.name != "__init__.py" and not p.name.startswith("__")}
    assert parts == set(ENTRYPOINTS_ALLOWED), "a new part of pagellm.entrypoints needs its rule here"
    for path in base.rglob("*.py"):
        part = path.relative_to(base).parts[0].removesuffix(".py")
        if part == "__init__":
            continue
        used = {n.split(".")[2] for n in imports_of(path) if n.startswith("pagellm.entrypoints.") and n.count(".") >= 2}
        assert used - {part} <= ENTRYPOINTS_ALLOWED[part], (path, used - {part} - ENTRYPOINTS_ALLOWED[part])
