"""Every fenced ```python block of README.md and docs/*.md runs, and shows what it says.

A user copies these examples verbatim, so each one runs here as they would run it: in a
fresh process (a child of the warm interpreter, tests/support/warm.py), in an empty
working directory, with the memlord under test, and must end with status 0, without a
traceback and without a warning. The test id is the block's place, ``docs/api.md:123``
(the line of its opening fence).

What a block shows is checked too:

* an interactive session (``>>>`` lines) is a doctest: each output is compared with what
  the block prints (``...`` stands for anything, whitespace is not compared);
* a line of code ending in a comment that names an exception (``lord.allocated(0)  #
  TypeError: argument 'device': expected ...``), or followed by a comment line that does,
  must raise that exception, with that message (up to a ``...``);
* comment lines right after a ``print()`` that start with ``# {``, ``# [`` or ``# (``
  are what it prints (a doctest's output: ``...`` for anything);
* a line whose comment starts with an integer (``fit.predict(32)  # 30417024: ...``)
  shows its value, or that of the first name it assigns; ``+400 B`` in a comment is how
  much the lord's ledger grows across that line, ``4 MiB credited`` how much it shrinks,
  ``nothing credited`` that it stays (at any depth: inside a ``with`` too);
* a block's code is compiled as the file ``train.py``, at the lines the block shows, so a
  call site the docs print (``'site': 'train.py:3'``) is the one memlord reports.

A block that is a fragment (it uses names the prose around it defines: ``model``,
``train_step``, a ``lord``) says which in an HTML comment right before it, which
markdown does not render::

    <!-- example: setup=lord+model -->

the names are the preludes of ``SETUPS`` below, run first in the same process. Other
words of that comment:

* ``continue``: the block goes on from the file's previous python block: they run in one
  process, one after the other, as one test (named by the first block; a failure names
  the block that failed);
* ``output``: the fence right after the block (a plain one) is what the block prints,
  compared as a doctest's output;
* ``numbers vary``: the doctest outputs are compared without their numbers (a machine's
  memory, an address, a time);
* ``waits``: the block waits out a timeout here (no GPU): it runs in a process of its
  own, started with the first test, beside the others;
* ``pytest``: the block is a test module: it runs under pytest with memlord's plugin and
  its tests must pass;
* ``skip (why)``: the block cannot run here (it needs a CUDA GPU, or it is a signature
  or a format, not code). Skips are few: ``MAX_SKIPPED`` is their number, and a new one
  must raise it here, in review.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import warm

import memlord

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
#: the folder that holds the memlord under test (the checkout, or site-packages in tox)
MEMLORD_HOME = Path(memlord.__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT_S = 120
#: the blocks marked ``skip``: a new skip raises this number, with its reason in the doc
MAX_SKIPPED = 8

_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*example:\s*(.*?)\s*-->\s*$")

# The preludes a fragment names: the names its prose gives it, made as small as possible.
SETUPS: dict[str, str] = {
    # a lord, and what every example imports
    "lord": """
        import numpy as np
        import torch
        from torch import nn
        import memlord
        from memlord import MemLord
        lord = MemLord()
    """,
    # a small model and its training step: model(x) is a tensor (no optimizer: creating
    # one imports torch._dynamo, a second in every process)
    "model": """
        import torch
        from torch import nn
        torch.manual_seed(0)
        def build_model():
            return nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 16))
        model = build_model()
        x = torch.randn(8, 128)
        batch = x
        def train_step(batch=None):
            model.zero_grad(set_to_none=True)
            model(x if batch is None else batch).sum().backward()
        loader = [torch.randn(8, 128) for _ in range(4)]
    """,
    # a language model whose output has a .loss, as a transformers model's has
    "lm": """
        import sys
        import types
        import torch
        sys.path.insert(0, TESTS)
        from support.tiny_lm import TinyLM
        torch.manual_seed(0)
        class LM(TinyLM):
            def forward(self, idx):
                return types.SimpleNamespace(loss=super().forward(idx, idx))
        def build_model():
            return LM()
        model = build_model()
        batch = torch.randint(0, 256, (4, 32))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    """,
    # the small transformer of docs/sizing.md (tests/support/tiny_lm.py)
    "tiny_lm": """
        import sys
        sys.path.insert(0, TESTS)
        from support.tiny_lm import TinyLM
    """,
    # docs/sizing.md's model and step(batch_size), as its first block makes them
    "sizing": """
        import sys
        sys.path.insert(0, TESTS)
        from support.tiny_lm import training
        model, opt, step = training()
    """,
    # the tensors a loop walks
    "tensors": """
        import torch
        tensors = [torch.empty(16) for _ in range(1000)]
    """,
    # a capacity source
    "capacity_fn": """
        def fn(device):
            return (1_000_000, 250_000)
    """,
    # a cache a server keeps
    "kv_cache": """
        class KVCache:
            def evict(self, nbytes):
                pass
        kv_cache = KVCache()
    """,
    # one rank of a gloo job of one process (torchrun's variables)
    "one_rank": """
        import os
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        steps = 2
    """,
    # a profile document, as `python -m memlord run --json profile.json` writes one
    "profile": """
        import torch
        from memlord import MemLord
        _lord = MemLord()
        _lord.record_events(1 << 16)
        with _lord.hook_into_python():
            _t = torch.ones(1000)
        _lord.export("profile.json")
        del _lord, _t
    """,
    # the post-mortem of a CPU allocation that failed, under the name docs/oom.md reads
    "post_mortem": """
        import glob
        import os
        import torch
        from memlord import MemLord
        _lord = MemLord()
        _hooks = _lord.hook_into_python()
        _lord.watch_oom("oom-reports")
        _keep = torch.ones(1000)
        try:
            torch.empty(1 << 62, dtype=torch.uint8)
        except RuntimeError:
            pass
        (_pm,) = glob.glob("oom-reports/*.json")
        os.replace(_pm, "memlord-oom-host-1234-0.json")
        _hooks.disable()
    """,
    # the tensors of each step, for LifetimeAnalyzer.record_usage
    "usage": """
        import torch
        _w = torch.ones(256)
        training_tensors = [[_w, torch.ones(64 * (i + 1))] for i in range(4)]
    """,
}


@dataclass(frozen=True)
class Block:
    path: str  # relative to the checkout
    line: int  # the opening fence's line (1-based)
    code: str
    words: tuple[str, ...]  # the directive's words, in order
    setups: tuple[str, ...]
    skip: str | None  # the reason, for a skipped block
    output: str | None = None  # what it prints (the ``output`` word)

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def _parse_directive(text: str) -> tuple[tuple[str, ...], tuple[str, ...], str | None]:
    skip = None
    m = re.match(r"skip\s*\((.+)\)$", text)
    if m:
        return ("skip",), (), m.group(1).strip()
    words = tuple(w.strip() for w in text.split(",") if w.strip())
    setups: tuple[str, ...] = ()
    for w in words:
        if w.startswith("setup="):
            setups = tuple(w.removeprefix("setup=").split("+"))
            for s in setups:
                if s not in SETUPS:
                    raise ValueError(f"unknown setup {s!r} in <!-- example: {text} -->")
        elif w not in ("continue", "numbers vary", "pytest", "output", "waits"):
            raise ValueError(f"unknown word {w!r} in <!-- example: {text} -->")
    return words, setups, skip


def doc_blocks(path: Path) -> list[Block]:
    """The fenced python blocks of one markdown file, with their directives."""
    rel = path.relative_to(ROOT).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2)
        j = i + 1
        while j < len(lines) and not re.match(r"^\s*```\s*$", lines[j]):
            j += 1
        if lang == "python":
            d = _DIRECTIVE.match(lines[i - 1]) if i else None
            words, setups, skip = _parse_directive(d.group(1)) if d else ((), (), None)
            body = "\n".join(
                ln[len(indent) :] if ln.startswith(indent) else ln for ln in lines[i + 1 : j]
            )
            if "continue" in words and not out:
                raise ValueError(f"{rel}:{i + 1}: 'continue' with no python block before it")
            output = None
            if "output" in words:
                k = j + 1
                while k < len(lines) and not lines[k].strip():
                    k += 1
                e = k + 1
                while e < len(lines) and not re.match(r"^\s*```\s*$", lines[e]):
                    e += 1
                if k >= len(lines) or not re.match(r"^\s*```(text)?\s*$", lines[k]):
                    raise ValueError(f"{rel}:{i + 1}: 'output' with no plain fence after the block")
                output = "\n".join(lines[k + 1 : e]) + "\n"
            out.append(Block(rel, i + 1, body + "\n", words, setups, skip, output))
        i = j + 1
    return out


def cases(blocks: list[Block]) -> list[list[Block]]:
    """The tests: each block, with the blocks that continue it."""
    out: list[list[Block]] = []
    for b in blocks:
        if "continue" in b.words:
            out[-1].append(b)
        else:
            out.append([b])
    return out


BLOCKS = [b for p in DOCS for b in doc_blocks(p)]
CASES = [c for p in DOCS for c in cases(doc_blocks(p))]


# The child: runs the preludes, then each block (its predecessors first), as train.py.
RUNNER = r"""
import ast, contextlib, doctest, io, json, re, sys, traceback
payload = json.loads(sys.argv[1])
_ERR = re.compile(r"#\s*([A-Z]\w*(?:Error|Exception))\b(?::\s*(.*)|\s*\(.*\))?$")
_NUM = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?")
ns = {"__name__": "__main__", "TESTS": payload["tests"]}
for name, code in payload["setups"]:
    exec(compile(code, f"<setup {name}>", "exec"), ns)

def check_raise(code, lines, exc_name, msg, where):
    try:
        exec(code, ns)
    except Exception as e:
        if type(e).__name__ != exc_name:
            got = f"{type(e).__name__}: {e}"
            raise AssertionError(f"{where}: expected {exc_name}, got {got}") from e
        if msg and msg != "(the same)":
            got = str(e)
            if "..." in msg:
                ok = got.startswith(msg.split("...")[0].rstrip())
            else:
                ok = got == msg or got == msg.rstrip(".")
            if not ok:
                raise AssertionError(f"{where}: {exc_name} message\n  doc: {msg}\n  got: {got}")
    else:
        raise AssertionError(f"{where}: expected {exc_name}, nothing raised")

# a line whose comment starts with an integer shows the value of its expression (or of
# the first name it assigns)
_VALUE = re.compile(r"#\s*(-?\d+)\s*(?::|$)")
# a line (at any depth) whose comment says "+<size>", "<size> (is) credited" or "nothing
# credited" shows how the lord's ledger changes across it
_SIZE = r"(\d[\d,.]*) ?(B|KiB|MiB|GiB)\b"
_GROW = re.compile(r"#.*\+" + _SIZE)
_FREED = re.compile(r"#.*?" + _SIZE + r"(?: is)? credited")
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}

def _claim(line):
    for rx, sign in ((_GROW, 1), (_FREED, -1)):
        m = rx.search(line)
        if m:
            return sign * round(float(m.group(1).replace(",", "")) * _UNITS[m.group(2)])
    return 0 if re.search(r"#.*\bnothing credited", line) else None

def _ledger():
    lord = ns.get("lord")
    return None if lord is None else lord.allocated()[0]

def _check_ledger(before, want, where):
    if before is None:
        raise AssertionError(f"{where}: the comment shows a change of the ledger, no lord")
    got = _ledger() - before
    if got != want:
        raise AssertionError(f"{where}: the doc shows a change of {want:+} B, the ledger {got:+} B")

ns["__ml_ledger"], ns["__ml_check"] = _ledger, _check_ledger

class _LedgerClaims(ast.NodeTransformer):
    def __init__(self, lines, where):
        self.lines, self.where = lines, where

    def generic_visit(self, node):
        super().generic_visit(node)
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if not isinstance(stmts, list) or not stmts or not isinstance(stmts[0], ast.stmt):
                continue
            out = []
            for st in stmts:
                want = None
                if st.lineno == st.end_lineno and not isinstance(st, (ast.With, ast.For, ast.If)):
                    want = _claim(self.lines[st.lineno - 1])
                if want is None:
                    out.append(st)
                    continue
                where = f"{self.where} line {st.lineno}"
                pre = ast.parse("__ml_before = __ml_ledger()").body[0]
                post = ast.parse(f"__ml_check(__ml_before, {want}, {where!r})").body[0]
                pre._ml = post._ml = True  # run as they are: no claim of their own
                out += [ast.copy_location(pre, st), st, ast.copy_location(post, st)]
            setattr(node, field, out)
        return node

def _first_name(stmt):
    if isinstance(stmt, ast.Assign):
        t = stmt.targets[0]
        t = t.elts[0] if isinstance(t, ast.Tuple) and t.elts else t
        if isinstance(t, ast.Name):
            return t.id
    return None

# the comment lines right after a print() that start with '# {', '# [' or '# (': what it
# prints (up to the bracket that closes the first)
def _shown_output(lines, stmt):
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "print"):
        return None
    text = []
    for ln in lines[stmt.end_lineno :]:
        if not ln.startswith("#"):
            break
        text.append(ln[1:].strip())
    shown = " ".join(text)
    if not shown[:1] in ("{", "[", "("):
        return None
    depth = 0
    for k, ch in enumerate(shown):
        depth += ch in "{[("
        depth -= ch in "}])"
        if depth == 0:
            return shown[: k + 1] + "\n"
    return None

def run_script(block):
    src = block["code"]
    lines = src.splitlines()
    tree = ast.parse(src, "train.py")
    tree = ast.fix_missing_locations(_LedgerClaims(lines, block["id"]).visit(tree))
    for stmt in tree.body:
        if getattr(stmt, "_ml", False):
            exec(compile(ast.Module([stmt], []), "train.py", "exec"), ns)
            continue
        end = lines[stmt.end_lineno - 1]
        m = _ERR.search(end) if stmt.lineno == stmt.end_lineno else None
        after = lines[stmt.end_lineno] if stmt.end_lineno < len(lines) else ""
        if m is None and after.lstrip().startswith("#"):
            m = _ERR.match(after.strip())  # the error on the comment line after it
        code = compile(ast.Module([stmt], []), "train.py", "exec")
        where = f"{block['id']} line {stmt.lineno}"
        if m:
            check_raise(code, lines, m.group(1), (m.group(2) or "").strip(), where)
            continue
        shown = _shown_output(lines, stmt)
        if shown is not None:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(code, ns)
            flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
            if not doctest.OutputChecker().check_output(shown, out.getvalue(), flags):
                raise AssertionError(
                    f"{where}: the doc shows {shown.strip()}\n  memlord prints {out.getvalue()}"
                )
            sys.stdout.write(out.getvalue())
            continue
        value = _VALUE.search(end) if stmt.lineno == stmt.end_lineno else None
        if value and isinstance(stmt, ast.Expr):
            got = eval(compile(ast.Expression(stmt.value), "train.py", "eval"), ns)
        else:
            exec(code, ns)
            got = ns.get(_first_name(stmt)) if value else None
        if value and got != int(value.group(1)):
            raise AssertionError(f"{where}: the doc shows {value.group(1)}, memlord gives {got!r}")

def run_doctest(block):
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    checker = doctest.OutputChecker()
    vary = "numbers vary" in block["words"]
    for ex in doctest.DocTestParser().get_examples(block["code"]):
        out = io.StringIO()
        code = compile("\n" * ex.lineno + ex.source, "train.py", "single")
        with contextlib.redirect_stdout(out):
            exec(code, ns)
        got, want = out.getvalue(), ex.want
        if vary:
            got, want = _NUM.sub("0", got), _NUM.sub("0", want)
        if not checker.check_output(want, got, flags):
            raise AssertionError(
                f"{block['id']} line {ex.lineno + 1}: {ex.source.strip()}\n"
                f"  the doc shows: {ex.want.strip()}\n  memlord gives: {out.getvalue().strip()}"
            )

def run_pytest(block):
    import pytest
    with open("test_example.py", "w") as f:
        f.write("import pytest\nimport torch\n" + block["prelude"] + block["code"])
    rc = pytest.main(["-q", "-p", "no:cacheprovider", "test_example.py"])
    if rc != 0:
        raise AssertionError(f"{block['id']}: pytest exited {rc}")

for block in payload["blocks"]:
    print(f"--- example {block['id']}", file=sys.stderr, flush=True)
    with open("train.py", "w") as f:
        f.write(block["code"])
    if "pytest" in block["words"]:
        run_pytest(block)
    elif block["code"].lstrip().startswith(">>>"):
        run_doctest(block)
    elif block["output"] is not None:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            run_script(block)
        flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
        if not doctest.OutputChecker().check_output(block["output"], out.getvalue(), flags):
            raise AssertionError(
                f"{block['id']}: the doc shows the output\n{block['output']}"
                f"memlord prints\n{out.getvalue()}"
            )
    else:
        run_script(block)
"""


def _payload(chain: list[Block]) -> str:
    setups: list[str] = []
    for b in chain:
        setups += [s for s in b.setups if s not in setups]
    preludes = [(s, textwrap.dedent(SETUPS[s])) for s in setups]
    blocks = []
    for b in chain:
        prelude = (
            "".join(f"TESTS = {str(TESTS)!r}\n" + code for _, code in preludes)
            if "pytest" in b.words
            else ""
        )
        blocks.append(
            {
                "id": b.id,
                "code": b.code,
                "words": list(b.words),
                "prelude": prelude,
                "output": b.output,
            }
        )
    return json.dumps({"tests": str(TESTS), "setups": preludes, "blocks": blocks})


_WARNING = re.compile(r"^.*\b\w*Warning\b:.*$", re.M)
# torch's own, not the example's: torch 2.11 warns at the first cycle of any profile made
# without acc_events (2.13 only when a profile object is started again); an example that
# uses torch.profiler (the profiler's track_pytorch_ops) gets it there
_TORCH_PROFILER_QUIRK = "Profiler clears events at the end of each cycle"


def _warnings_of(stderr: str) -> list[str]:
    return [w for w in _WARNING.findall(stderr) if _TORCH_PROFILER_QUIRK not in w]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(MEMLORD_HOME)
    for k in ("DEBUG", "NO_COLOR", "FORCE_COLOR", "MEMLORD_PUBLISH", "MEMLORD_COOPERATE"):
        env.pop(k, None)
    return env


@pytest.fixture(scope="module")
def waiting(tmp_path_factory):
    """The cases marked ``waits``, started at once in processes of their own (a fresh
    interpreter each): they wait out a timeout while the others run."""
    procs = {}
    for chain in CASES:
        if "waits" in chain[0].words and chain[0].skip is None:
            cwd = tmp_path_factory.mktemp("waits")
            procs[chain[0].id] = subprocess.Popen(
                [sys.executable, "-c", RUNNER, _payload(chain)],
                cwd=cwd,
                env=_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _writes_html(chain: list[Block]) -> bool:
    """An example that writes an HTML report, which needs the memlord[report] extra."""
    return any(re.search(r"""\.html?["']|\bhtml=""", b.code) for b in chain)


@pytest.mark.parametrize("chain", CASES, ids=[c[0].id for c in CASES])
def test_doc_example_runs(chain: list[Block], tmp_path, waiting):
    block = chain[0]
    if block.skip is not None:
        pytest.skip(block.skip)
    if _writes_html(chain) and importlib.util.find_spec("plotly") is None:
        # an interpreter without the extra (CI's py has it, and sets this variable)
        if os.environ.get("MEMLORD_REQUIRE_BROWSER"):
            pytest.fail("an HTML example needs memlord[report] (plotly), not installed")
        pytest.skip("writes HTML: needs the memlord[report] extra (plotly)")
    if block.id in waiting:
        proc = waiting[block.id]
        out, err = proc.communicate(timeout=TIMEOUT_S)
        r = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    else:
        r = warm.run(
            [sys.executable, "-c", RUNNER, _payload(chain)],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    ran = re.findall(r"^--- example (\S+)$", r.stderr, re.M)
    where = ran[-1] if ran else block.id
    report = f"{where} exited {r.returncode}\n--- stdout\n{r.stdout[-4000:]}\n"
    report += f"--- stderr\n{r.stderr[-6000:]}"
    assert r.returncode == 0, report
    assert "Traceback" not in r.stderr, report
    assert "Exception ignored" not in r.stderr, report
    assert not _warnings_of(r.stderr), report


def test_skipped_blocks_are_few_and_say_why():
    skipped = [b for b in BLOCKS if b.skip is not None]
    assert len(skipped) <= MAX_SKIPPED, [f"{b.id}: {b.skip}" for b in skipped]
    assert all(len(b.skip or "") >= 10 for b in skipped), [b.id for b in skipped]


def test_every_doc_has_its_python_blocks_found():
    """The parser sees every ```python fence (a fence it missed would be an example no
    test runs)."""
    for p in DOCS:
        fences = sum(
            1
            for ln in p.read_text(encoding="utf-8").splitlines()
            if re.match(r"^\s*```python\s*$", ln)
        )
        assert fences == sum(1 for b in BLOCKS if b.path == p.relative_to(ROOT).as_posix()), p
    assert len(BLOCKS) >= 60


def _memlord_commands() -> list[tuple[str, list[str]]]:
    """Every `python -m memlord ...` (or `torchrun ... -m memlord ...`) command line of the
    docs' shell blocks: (place, its arguments after `memlord`)."""
    out = []
    for p in DOCS:
        rel = p.relative_to(ROOT).as_posix()
        fence = None
        for n, ln in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            m = _FENCE.match(ln)
            if m and fence is None:
                fence = m.group(2)
                continue
            if re.match(r"^\s*```\s*$", ln) and fence is not None:
                fence = None
                continue
            if fence not in ("bash", "sh", "console"):
                continue
            for part in re.split(r"&&|;|(?<!&)&(?!&)", ln.split(" #")[0]):
                words = shlex.split(part)
                for k in range(len(words) - 1):
                    if words[k] == "-m" and words[k + 1] == "memlord":
                        out.append((f"{rel}:{n}", words[k + 2 :]))
    return out


COMMANDS = _memlord_commands()


@pytest.mark.parametrize("where,args", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_doc_command_lines_parse(where, args, capsys):
    """Each documented command line is one memlord's command-line parser accepts: every
    option it shows exists, with the arguments it shows (the commands themselves run in
    test_cli_*.py)."""
    from memlord import cli

    if args and args[0] in ("run", "report", "gantt", "top", "merge"):
        try:
            cli._parser().parse_args(args)
        except SystemExit as e:
            pytest.fail(f"{where}: memlord {' '.join(args)}: {capsys.readouterr().err}{e}")
    else:
        assert set(args) <= {"--info", "--version"} or args[:1] == ["--layers"], (where, args)


def test_the_docs_show_memlord_commands():
    assert len(COMMANDS) >= 10, COMMANDS
