"""The house's walls as tests: rooms, imports, torch, websockets, event loops, threads, sizes.

The map in ``ARCHITECTURE.md`` is the source: its room block gives the rooms, their order and
which of them are torch-free; its "Threads and their owners" list names the modules that may
start threads. Each check below is a function of a source tree, so that
``test_every_wall_catches_its_violation`` can run it on a small tree built to break it: a check
that cannot fail is no wall.

Imports are read with ``ast``, all of them: module level, inside functions, under
``TYPE_CHECKING``. The one module any room may import is ``kit/__init__.py`` itself (the version
and hivemind's names, re-exported lazily by PEP 562: importing it imports nothing else).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 600
#: Constructors of threads and thread pools.
THREAD_MAKERS = frozenset({"Thread", "Timer", "ThreadPoolExecutor", "ThreadPool"})
TRANSPORT = "kit.p2p.transport"  # the one module that may import websockets
LOOP_OWNER = "kit.runtime"  # the one module that may make event loops


@dataclass(frozen=True)
class Room:
    names: tuple[str, ...]  # the map's names on one line, e.g. ("errors.py",) or ("p2p/",)
    rank: int  # position in the map; a room imports only rooms of a smaller rank
    torch_free: bool


@dataclass(frozen=True)
class Import:
    source: str  # importing module, e.g. "kit.p2p.peer"
    target: str  # imported kit module (or a third-party name), e.g. "kit.p2p.wire"
    line: int


# --- reading the map and the tree ---------------------------------------------------------------


def read_map(architecture: str) -> dict[str, Room]:
    """Map each room name ("p2p", "errors", ...) of the ```` ``` ```` block that follows
    "## Rooms and data flow" to its place; names on one line rank left to right."""
    section = architecture.split("## Rooms and data flow", 1)[1]
    block = section.split("```", 2)[1]
    entries: list[tuple[list[str], str]] = []
    for line in block.splitlines():
        if not line.strip():
            continue
        if line[0].isspace():  # the description goes on
            entries[-1] = (entries[-1][0], entries[-1][1] + " " + line.strip())
            continue
        names, _, description = (re.split(r"(\s{2,})", line, maxsplit=1) + ["", ""])[:3]
        entries.append(([n.strip() for n in names.split(",")], description))
    rooms: dict[str, Room] = {}
    rank = 0
    for names, description in entries:
        torch_free = "(torch-free)" in description
        for name in names:
            if not re.fullmatch(r"[a-z_][a-z0-9_]*(\.py|/)", name):
                raise AssertionError(f"ARCHITECTURE.md: {name!r} is neither a module nor a folder")
            rooms[name.removesuffix(".py").removesuffix("/")] = Room(tuple(names), rank, torch_free)
            rank += 1
    return rooms


def read_thread_owners(architecture: str) -> set[str]:
    """The modules listed under "## Threads and their owners" (``- `kit/x/y.py`: ...``)."""
    section = architecture.split("## Threads and their owners", 1)[1].split("\n## ", 1)[0]
    return {
        module_name(Path(path))
        for path in re.findall(r"^- `(kit/[\w/]+\.py)`", section, flags=re.MULTILINE)
    }


def module_name(relative: Path) -> str:
    parts = list(relative.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path) -> dict[str, Path]:
    """Every module of the ``kit`` package under ``root``, by dotted name."""
    return {module_name(p.relative_to(root)): p for p in sorted((root / "kit").rglob("*.py"))}


def room_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""  # "" = kit/__init__.py


def imports(root: Path, module: str, path: Path) -> Iterator[Import]:
    """Every import in ``path``, resolved to the kit module it loads (or a third-party name)."""
    known = modules(root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # "from kit import evaluate" loads kit.evaluate; "from kit.x import name" loads kit.x
            targets = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            targets = targets or [base]
        else:
            continue
        for target in targets:
            while target.startswith("kit.") and target not in known:
                target = target.rpartition(".")[0]
            yield Import(module, target, node.lineno)


def kit_imports(root: Path) -> list[Import]:
    return [
        found
        for module, path in modules(root).items()
        for found in imports(root, module, path)
        if found.target.startswith("kit") and found.target not in (module, "kit")
    ]


def calls(path: Path) -> Iterator[tuple[str, str, int]]:
    """(receiver, name, line) of every call, through import aliases: ``asyncio.run(...)``,
    ``aio.run(...)`` after ``import asyncio as aio`` and ``run(...)`` after ``from asyncio
    import run`` all give ("asyncio", "run")."""
    tree = ast.parse(path.read_text(), str(path))
    modules_as: dict[str, str] = {}  # local name -> module
    names_as: dict[str, tuple[str, str]] = {}  # local name -> (module, name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                modules_as[alias.asname or alias.name] = alias.name.rpartition(".")[2]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                names_as[alias.asname or alias.name] = (node.module.rpartition(".")[2], alias.name)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        function = node.func
        if isinstance(function, ast.Attribute):
            receiver = function.value
            name = ""
            if isinstance(receiver, ast.Name):
                name = modules_as.get(receiver.id, receiver.id)
            elif isinstance(receiver, ast.Attribute):
                name = receiver.attr
            yield name, function.attr, node.lineno
        elif isinstance(function, ast.Name):
            yield names_as.get(function.id, ("", function.id)) + (node.lineno,)


# --- the walls ----------------------------------------------------------------------------------


def check_rooms(root: Path, rooms: dict[str, Room]) -> list[str]:
    """Every module in a room of the map; every import to the same room or one above."""
    problems = [
        f"{module} is in no room of ARCHITECTURE.md's map - help: add it where it belongs"
        for module in modules(root)
        if room_of(module) and room_of(module) not in rooms
    ]
    for found in kit_imports(root):
        source, target = rooms.get(room_of(found.source)), rooms.get(room_of(found.target))
        if source is None or target is None or source == target:
            continue
        if target.rank > source.rank:
            problems.append(
                f"{found.source}:{found.line} imports {found.target}, a room below it in the map"
            )
    return problems


def check_cycles(root: Path) -> list[str]:
    """No two kit modules import each other, directly or through others."""
    graph: dict[str, set[str]] = {}
    for found in kit_imports(root):
        graph.setdefault(found.source, set()).add(found.target)
    cycles, state = [], dict.fromkeys(graph, 0)  # 0 new, 1 on the path, 2 done
    for start in graph:
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        if state[start]:
            continue
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(child, 2) == 1:
                cycles.append(" -> ".join(path[path.index(child) :] + [child]))
            elif state.get(child) == 0:
                state[child] = 1
                stack.append((child, iter(sorted(graph[child]))))
                path.append(child)
    return [f"import circle: {cycle}" for cycle in cycles]


def check_websockets(root: Path) -> list[str]:
    return [
        f"{module}:{found.line} imports {found.target} - help: only {TRANSPORT} speaks websockets"
        for module, path in modules(root).items()
        for found in imports(root, module, path)
        if found.target.split(".")[0] == "websockets" and module != TRANSPORT
    ]


def makes_a_loop(receiver: str, name: str) -> bool:
    """``asyncio.run``/``Runner``/``get_event_loop`` (which makes one when none runs), and any
    ``new_event_loop`` (asyncio's, uvloop's, or imported bare)."""
    if name == "new_event_loop":
        return True
    return receiver in ("asyncio", "uvloop") and name in ("run", "Runner", "get_event_loop")


def check_event_loops(root: Path) -> list[str]:
    return [
        f"{module}:{line} makes an event loop ({receiver}.{name}) - help: run coroutines on "
        "kit.runtime.get_runtime()"
        for module, path in modules(root).items()
        if module != LOOP_OWNER
        for receiver, name, line in calls(path)
        if makes_a_loop(receiver, name)
    ]


def check_threads(root: Path, owners: set[str]) -> list[str]:
    starters = {
        module: line
        for module, path in modules(root).items()
        for _, name, line in calls(path)
        if name in THREAD_MAKERS
    }
    problems = [
        f"{module}:{line} starts a thread but is not an owner in ARCHITECTURE.md's "
        "'Threads and their owners' - help: run it on the runtime loop, or name the owner there"
        for module, line in sorted(starters.items())
        if module not in owners
    ]
    problems += [
        f"ARCHITECTURE.md names {module} as a thread owner, but it starts no thread"
        for module in sorted(owners - set(starters))
    ]
    return problems


def check_sizes(root: Path) -> list[str]:
    return [
        f"{module} has {lines} lines (> {MAX_LINES}) - help: split it by concept"
        for module, path in modules(root).items()
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    ]


def check_private_calls(root: Path) -> list[str]:
    """No ``other._name`` where ``_name`` is defined in another kit module and not here."""
    defined: dict[str, set[str]] = {}
    for module, path in modules(root).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.setdefault(node.name, set()).add(module)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                defined.setdefault(node.attr, set()).add(module)
    problems = []
    for module, path in modules(root).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                and module not in defined.get(node.attr, {module})
            ):
                owner = sorted(defined[node.attr])[0]
                problems.append(
                    f"{module}:{node.lineno} uses {node.attr}, private to {owner} - help: give "
                    "it a public name or pass what it needs"
                )
    return problems


def check_torch_free(root: Path, rooms: dict[str, Room]) -> list[str]:
    """Import every module of the torch-free rooms in a fresh interpreter where torch fails."""
    wanted = [m for m in modules(root) if (room := rooms.get(room_of(m))) and room.torch_free]
    script = textwrap.dedent(
        """
        import importlib, sys
        sys.path.insert(0, sys.argv[1])

        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked: this room must stay torch-free")

        sys.meta_path.insert(0, NoTorch())
        for module in sys.argv[2:]:
            try:
                importlib.import_module(module)
            except Exception as error:
                print(f"{module}: {type(error).__name__}: {error}")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(root), *wanted],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return [
        f"{line} - help: import torch lazily, where it is used"
        for line in result.stdout.splitlines()
    ]


# --- the house as it is -------------------------------------------------------------------------

ARCHITECTURE = (REPO / "ARCHITECTURE.md").read_text()
ROOMS = read_map(ARCHITECTURE)


def test_every_module_is_in_a_room_and_imports_follow_the_map() -> None:
    assert not check_rooms(REPO, ROOMS), "\n".join(check_rooms(REPO, ROOMS))


def test_no_import_circle_between_modules() -> None:
    assert not check_cycles(REPO), "\n".join(check_cycles(REPO))


def test_only_the_transport_imports_websockets() -> None:
    assert not check_websockets(REPO), "\n".join(check_websockets(REPO))


def test_only_the_runtime_makes_event_loops() -> None:
    assert not check_event_loops(REPO), "\n".join(check_event_loops(REPO))


def test_only_the_named_owners_start_threads() -> None:
    owners = read_thread_owners(ARCHITECTURE)
    assert LOOP_OWNER in owners and len(owners) >= 5  # the list was found and read
    assert not check_threads(REPO, owners), "\n".join(check_threads(REPO, owners))


def test_no_module_over_600_lines() -> None:
    assert not check_sizes(REPO), "\n".join(check_sizes(REPO))


def test_no_module_calls_another_modules_private_names() -> None:
    assert not check_private_calls(REPO), "\n".join(check_private_calls(REPO))


def test_torch_free_rooms_import_without_torch() -> None:
    free = {name for name, room in ROOMS.items() if room.torch_free}
    assert {"p2p", "dht", "auth", "config", "metrics", "dashboard"} <= free
    assert not check_torch_free(REPO, ROOMS), "\n".join(check_torch_free(REPO, ROOMS))


# --- each wall can fail ---------------------------------------------------------------------------

TINY_MAP = """
## Rooms and data flow

```
errors.py                       the exception tree (torch-free)
p2p/                            the network (torch-free)
optim/                          the optimizer
runtime_like.py                 a module that owns a thread
```

## Threads and their owners

- `kit/runtime_like.py`: a thread.
- `kit/optim/ghost.py`: named, but starts none.
"""


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_every_wall_catches_its_violation(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "kit/__init__.py": "",
            "kit/errors.py": "import kit\n",  # the root package: allowed from anywhere
            "kit/p2p/__init__.py": "",
            "kit/p2p/wire.py": """
                import websockets  # only the transport may

                def later():
                    from kit.optim import step  # upward, even inside a function
                    return step
                """,
            "kit/p2p/loop.py": """
                import asyncio
                import torch  # in a torch-free room
                from kit.p2p import wire

                asyncio.run(None)  # only the runtime makes loops
                """,
            "kit/p2p/aliased.py": """
                import asyncio as aio
                from asyncio import new_event_loop as fresh

                aio.get_event_loop(), fresh()
                """,
            "kit/optim/__init__.py": "",
            "kit/optim/step.py": """
                import threading
                from typing import TYPE_CHECKING

                from kit.errors import *  # downward: fine
                if TYPE_CHECKING:
                    from kit.optim import cycle_b

                threading.Thread(target=print).start()  # not an owner
                """,
            "kit/optim/cycle_b.py": "from kit.optim import step\n",
            "kit/optim/peer.py": "class Peer:\n    def _dial(self):\n        pass\n",
            "kit/optim/user.py": "def probe(peer):\n    return peer._dial()\n",
            "kit/optim/long.py": "x = 1\n" * (MAX_LINES + 1),
            "kit/nowhere.py": "",  # in no room
            "kit/runtime_like.py": "import threading\nthreading.Thread(target=print)\n",
        },
    )
    rooms = read_map(TINY_MAP)
    owners = read_thread_owners(TINY_MAP)
    assert owners == {"kit.runtime_like", "kit.optim.ghost"}

    rooms_found = "\n".join(check_rooms(tmp_path, rooms))
    assert "kit.nowhere is in no room" in rooms_found
    assert "kit.p2p.wire:5 imports kit.optim.step, a room below it" in rooms_found
    assert "kit.errors" not in rooms_found and "kit.optim.step:" not in rooms_found

    cycles = check_cycles(tmp_path)
    assert cycles == ["import circle: kit.optim.cycle_b -> kit.optim.step -> kit.optim.cycle_b"]

    assert check_websockets(tmp_path) == [
        "kit.p2p.wire:2 imports websockets - help: only kit.p2p.transport speaks websockets"
    ]
    loops = check_event_loops(tmp_path)
    assert [line.split(" - ")[0] for line in loops] == [
        "kit.p2p.aliased:5 makes an event loop (asyncio.get_event_loop)",
        "kit.p2p.aliased:5 makes an event loop (asyncio.new_event_loop)",
        "kit.p2p.loop:6 makes an event loop (asyncio.run)",
    ]

    threads = check_threads(tmp_path, owners)
    assert len(threads) == 2
    assert threads[0].startswith("kit.optim.step:9 starts a thread but is not an owner")
    assert (
        threads[1]
        == "ARCHITECTURE.md names kit.optim.ghost as a thread owner, but it starts no thread"
    )

    assert check_sizes(tmp_path) == [
        f"kit.optim.long has {MAX_LINES + 1} lines (> {MAX_LINES}) - help: split it by concept"
    ]
    (private,) = check_private_calls(tmp_path)
    assert private.startswith("kit.optim.user:2 uses _dial, private to kit.optim.peer")

    (torch,) = check_torch_free(tmp_path, rooms)
    assert torch.startswith("kit.p2p.loop: ImportError: torch is blocked")
