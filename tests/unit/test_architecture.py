"""The package's shape, checked from its source: imports point down the floors of docs/architecture.md (sideways
only along the edges it lists) and form no cycle; process groups are made in one place and reach the code through
the parallel context, never through the accessor layer that exists for users' code; ``torch.cuda`` is touched by
``device`` alone."""
import ast
import os

import megatronish

PKG = os.path.dirname(megatronish.__file__)

# The floors, top to bottom (docs/architecture.md). A module may import from its own room or from a lower floor.
FLOORS = {
    "env": 7,  # entry: ``python -m megatronish.env`` (the report's logic is tools.env)
    "tools": 6,  # console entry points (the tools/*.py scripts' logic)
    "planner": 6,  # megatronish-plan: layouts, memory and step time predicted without processes
    "arguments": 5, "training": 5, "convert": 5, "testing": 5, "inference": 5,
    "checkpoint": 4, "optim": 4, "precision": 4,
    "model": 3,
    "config": 2, "model_config": 2, "parallel_config": 2, "kernels": 2, "data": 2,
    "parallel": 1,
    "errors": 0, "device": 0, "__init__": 0, "_C": 0,
}
# The imports between two rooms of one floor that docs/architecture.md lists (importing module's prefix, target's).
SIDEWAYS = {
    ("megatronish.config", "megatronish.data.tokenizers"),
    ("megatronish.config", "megatronish.model_config"),
    ("megatronish.inference", "megatronish.arguments"),
    ("megatronish.inference", "megatronish.training.initialize"),
    ("megatronish.arguments.hf_args", "megatronish.convert"),
    ("megatronish.training", "megatronish.convert.hf_load"),
    ("megatronish.training", "megatronish.convert.hf_save"),
    ("megatronish.inference", "megatronish.convert.hf_load"),
    ("megatronish.tools.pretrain_gpt", "megatronish.planner.report"),
}


def _modules():
    """{dotted module name: path} for every source file of the package."""
    out = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.dirname(PKG))[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def _imports(name, path, modules):
    """Every ``megatronish`` module that ``name`` imports, at module level or inside functions (lazy imports
    count: they run up the floors just the same)."""
    is_pkg = path.endswith("__init__.py")
    package = name if is_pkg else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [f"{target}.{a.name}" for a in node.names] + [target]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        for c in candidates:
            if c in modules:
                found.add(c)
                break
    return found - {name}


def _room(module):
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def test_every_room_has_a_floor():
    rooms = {_room(m) for m in _modules()}
    assert rooms <= FLOORS.keys(), f"give {sorted(rooms - FLOORS.keys())} a floor here and in docs/architecture.md"


def _imports_between_rooms():
    """``(module, imported module, its floor, the imported one's floor)`` of every import across two rooms."""
    modules = _modules()
    for name, path in modules.items():
        for target in _imports(name, path, modules):
            if _room(name) != _room(target):
                yield name, target, FLOORS[_room(name)], FLOORS[_room(target)]


def test_imports_point_down_the_floors():
    upward = [f"{name} (floor {a}) imports {target} (floor {b})"
              for name, target, a, b in _imports_between_rooms() if a < b]
    assert not upward, "imports running up the floors:\n" + "\n".join(upward)


def test_sideways_imports_are_the_listed_ones():
    sideways = [f"{name} imports {target} (both floor {a})" for name, target, a, b in _imports_between_rooms()
                if a == b and not any((name + ".").startswith(src + ".") and (target + ".").startswith(dst + ".")
                                      for src, dst in SIDEWAYS)]
    assert not sideways, ("imports between rooms of one floor that docs/architecture.md does not list (move the "
                          "code down a floor, or list the edge there and in SIDEWAYS):\n" + "\n".join(sideways))


def _torch_cuda_uses(path):
    """Lines of ``path`` that reach ``torch.cuda``: the attribute, or an import of it."""
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Attribute) and node.attr == "cuda" and isinstance(node.value, ast.Name) \
                and node.value.id == "torch":
            yield node.lineno
        elif isinstance(node, ast.Import) and any(a.name.startswith("torch.cuda") for a in node.names):
            yield node.lineno
        elif isinstance(node, ast.ImportFrom) and (
                (node.module or "").startswith("torch.cuda")
                or (node.module == "torch" and any(a.name == "cuda" for a in node.names))):
            yield node.lineno


def test_only_device_touches_torch_cuda():
    uses = [f"{name}:{line}" for name, path in _modules().items() if name != "megatronish.device"
            for line in _torch_cuda_uses(path)]
    assert not uses, "torch.cuda outside megatronish/device.py (add a helper there):\n" + "\n".join(uses)


def test_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # a package's __init__ re-exporting its own modules is not a cycle through them
    for name in graph:
        graph[name] = {t for t in graph[name] if not (name.startswith(t + ".") and modules[t].endswith("__init__.py"))}
    state, stack, cycles = {}, [], []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _calls_and_attrs(path):
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            yield node.value.id, node.attr, node.lineno


def test_process_groups_are_made_in_one_place():
    makers = sorted(os.path.relpath(p, PKG) for m, p in _modules().items()
                    if any(attr == "new_group" for _, attr, _ in _calls_and_attrs(p)))
    assert makers == ["parallel/context.py"], makers


def test_the_package_does_not_read_the_accessor_layer():
    """``groups.*`` is for users' code: the package itself only builds the context through it (the entry)."""
    uses = []
    for name, path in _modules().items():
        if name == "megatronish.parallel.groups":
            continue
        for owner, attr, line in _calls_and_attrs(path):
            if owner == "groups" and attr != "initialize_model_parallel":
                uses.append(f"{name}:{line} groups.{attr}")
            if attr == "is_initialized" and owner != "dist":
                uses.append(f"{name}:{line} {owner}.is_initialized")
    assert not uses, "\n".join(uses)


# torch.distributed's communicating functions: the package calls them through parallel/comm_log.py, which records
# each one (docs/reliability.md, "A collective that hangs").
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "all_to_all", "all_to_all_single", "broadcast", "barrier", "monitored_barrier", "send", "recv",
               "isend", "irecv", "batch_isend_irecv", "gather", "scatter", "reduce", "all_gather_object",
               "broadcast_object_list", "gather_object", "scatter_object_list", "send_object_list",
               "recv_object_list", "reduce_scatter_single", "all_gather_single", "_all_gather_base",
               "_reduce_scatter_base"}
# Modules allowed to reach them directly: the recorder itself. (DCP's and FSDP2's own collectives run inside torch,
# which the package reaches through dcp.save/load and fully_shard, not through these names.)
COLLECTIVE_CALLERS = {"megatronish.parallel.comm_log"}


def _direct_collectives(path):
    """``dist.<collective>`` / ``torch.distributed.<collective>`` references and ``from torch.distributed import``
    of one, with their lines."""
    tree = ast.parse(open(path).read(), path)
    aliases = {"torch.distributed"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            for a in node.names:
                if a.name in COLLECTIVES:
                    yield node.lineno, f"from torch.distributed import {a.name}"
                elif a.name == "distributed_c10d":
                    aliases.add(a.asname or a.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES and ast.unparse(node.value) in aliases:
            yield node.lineno, ast.unparse(node)


def test_collectives_go_through_the_recorder():
    direct = [f"{name}:{line} {what}" for name, path in _modules().items() if name not in COLLECTIVE_CALLERS
              for line, what in _direct_collectives(path)]
    assert not direct, ("call these through megatronish.parallel.comm_log (its wrappers record the collective):\n"
                        + "\n".join(direct))


MAX_LINES = 600


def test_no_module_over_the_line_limit():
    """No module in megatronish/ or tools/ over MAX_LINES lines: a long module is split along its seams (a package
    of modules, e.g. checkpoint/dcp_io/, data/tokenizers/)."""
    root = os.path.dirname(PKG)
    long = []
    for top in (PKG, os.path.join(root, "tools")):
        for dirpath, _, files in os.walk(top):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    rel = os.path.relpath(path, root).replace(os.sep, "/")
                    with open(path) as fh:
                        n = sum(1 for _ in fh)
                    if n > MAX_LINES:
                        long.append(f"{rel}: {n} lines")
    assert not long, f"modules over {MAX_LINES} lines (split them along their seams):\n" + "\n".join(long)


# Module-level state that is mutated at run time, and why it may live in a module global. Everything else a run
# changes is owned by an object the run passes explicitly (the parallel context, the model, the Checkpointer,
# the watchdog's Watch, ...). Nothing joins this list without its reason.
MUTABLE_GLOBALS = {
    ("megatronish.parallel.groups", "_current"): "Megatron's parallel_state accessors, for users' code, read the "
                                                 "context the last initialize_model_parallel returned",
    ("megatronish.parallel.groups", "_made"): "the process groups this process has made (torch.distributed keeps "
                                              "each until destroyed): initialize_model_parallel with the same ranks "
                                              "takes them again instead of making more",
    ("megatronish.parallel.comm_log", "_LOG"): "the per-process ring of collectives a failed rank reports (every "
                                               "collective of the process, whichever object issued it)",
    ("megatronish.parallel.random", "_current"): "Megatron's get_cuda_rng_tracker() (get_rng_tracker), for users' "
                                                 "code, returns the tracker the last set_random_seed seeded (the "
                                                 "run's own, which setup passes to the model and checkpointer)",
    ("megatronish.precision.fp8", "_FP8_ENABLED"): "fp8_autocast(enabled): a process-wide switch scoped by a with "
                                                   "block, as Transformer Engine's is",
    # caches of facts about this process's machine or inputs (computed once, never changed after)
    ("megatronish.device", "_nvtx"): "the NVTX range of the CUDA profiler's capture, opened and closed in pairs",
    ("megatronish.precision.fp8", "_SCALED_MM_OK"): "whether torch._scaled_mm works on a device type",
    ("megatronish.checkpoint.common", "_CODE_VERSION"): "the package's version and git commit",
    ("megatronish.checkpoint.state", "_LIBC"): "the C library handle",
    ("megatronish.checkpoint.tensor_archive", "_FORMATS"): "torch.save's byte layout, learnt once per setting",
    ("megatronish.checkpoint.dcp_io.archive", "_LAYOUTS"): "the storage layouts of pickled metadata seen",
}
_MUTATORS = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault", "add",
             "discard", "appendleft", "__setitem__"}


def _mutable_globals(path):
    """``(line, name)`` of module globals rebound through ``global`` statements, and of module-level containers
    (dict, list, set literals or calls) mutated inside a function."""
    tree = ast.parse(open(path).read())
    containers = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        value = getattr(node, "value", None)
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set)) or (
            isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] in
            {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter"})
        for t in targets:
            if mutable and isinstance(t, ast.Name):
                containers[t.id] = node.lineno
    found = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Global):
                found.update((node.lineno, name) for name in node.names)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in _MUTATORS and isinstance(node.func.value, ast.Name) \
                    and node.func.value.id in containers:
                found.add((node.lineno, node.func.value.id))
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                for t in getattr(node, "targets", None) or [node.target]:
                    if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id in containers:
                        found.add((node.lineno, t.value.id))
    return sorted(found)


def test_no_mutable_module_globals():
    """No module keeps run-time state in a module global (``global`` rebinding, or a module-level dict/list/set
    mutated by its functions) outside MUTABLE_GLOBALS: such state has an owner the run passes explicitly."""
    found = [f"{name}:{line} {glob}" for name, path in _modules().items() for line, glob in _mutable_globals(path)
             if (name, glob) not in MUTABLE_GLOBALS]
    assert not found, ("module-level state changed at run time (give it an owner the run passes, or list it in "
                       "MUTABLE_GLOBALS with the reason):\n" + "\n".join(found))
    modules = _modules()
    stale = [f"{name}.{glob}" for name, glob in MUTABLE_GLOBALS
             if name not in modules or f"\n{glob}" not in "\n" + open(modules[name]).read()]
    assert not stale, "MUTABLE_GLOBALS lists names no module defines any more (remove them):\n" + "\n".join(stale)


# The modules of floors 0-3 whose code (not docstrings or comments) names a command-line flag, and why. Everything
# else there speaks of values: the flags live in arguments, config and parallel_config (degrees: parallel/ raises a
# DegreeError with numbers, parallel_config names the flags).
FLAG_STRINGS_ALLOWED = {
    "megatronish.config": "flags -> configs: the configs' own validation lines name their flags",
    "megatronish.model_config": "the model config's own validation lines name their flags",
    "megatronish.parallel_config": "the parallel layout's validation lines name the degree and shape flags",
    "megatronish.errors": "every entry point's parser: the closest known flag for a misspelt one",
    "megatronish.data": "data errors name --data-path / --split / the tokenizer flags a user must fix",
    "megatronish.kernels": "one configuration error names the kernel flags asked for on a machine without them",
    "megatronish.model.gpt": "GPTModel asks kernels for the flags it was built with (one configuration error)",
    "megatronish.model.rope": "the rotary dimension's error names --kv-channels x --rotary-percent",
    "megatronish.parallel.cross_entropy": "the loss's argument check names --label-smoothing (the value's flag)",
    "megatronish.parallel.context_parallel": "an unknown --cp-comm-type names its flag and the choices",
    "megatronish.parallel.fsdp": "an unknown --fsdp-reshard-after-forward policy names its flag and the choices",
}


def _megatron_flags():
    from megatronish.arguments import build_parser

    return {s for a in build_parser()._actions for s in a.option_strings if s.startswith("--")}


def _code_strings(tree):
    """String constants of a module's code: every str literal that is not a docstring."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.value


def test_no_flag_strings_below_floor_4():
    import re

    flags, word = _megatron_flags(), re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
    found = {}
    for name, path in _modules().items():
        if FLOORS[_room(name)] > 3:
            continue
        with open(path) as f:
            tree = ast.parse(f.read())
        named = {m for s in _code_strings(tree) for m in word.findall(s) if m in flags}
        if named and not any(name == a or name.startswith(a + ".") for a in FLAG_STRINGS_ALLOWED):
            found[name] = sorted(named)
    assert not found, f"flag strings below floor 4 (name values, or add the module to the allow-list with why): {found}"
    assert not any(name.startswith("megatronish.parallel.dims") for name in FLAG_STRINGS_ALLOWED)
