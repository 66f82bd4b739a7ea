"""The documentation says what the code does (issue 22): the callback's defaults in the user
guide's table, the command line's help; and its tables render as tables."""
import inspect
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def guide_table(title):
    """``{argument: default text}`` of the user guide's table under ``### title``."""
    text = open(os.path.join(ROOT, "docs", "user-guide.md")).read()
    section = text.split(f"### {title}", 1)[1].split("\n#", 1)[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| ([^|]+) \|", section, re.M)}


def test_the_callbacks_defaults_are_the_user_guides():
    pytest.importorskip("lightning")
    from nemo_dcr.integrations.publish import DeltaPublishCallback
    table = guide_table("`DeltaPublishCallback` arguments")
    params = inspect.signature(DeltaPublishCallback.__init__).parameters
    assert set(table) == set(params) - {"self"}
    for name, text in table.items():
        default = params[name].default
        if default is inspect.Parameter.empty:
            assert "required" in text, name
        else:
            assert text.strip() == f"`{default!r}`".replace("'", '"'), (name, text, default)
    doc = DeltaPublishCallback.__doc__
    for choice in ("auto", "portable", "classes", "xor", "add", "overwrite"):
        assert f"``{choice}``" in doc.split("encoding:", 1)[1].split("level:", 1)[0], choice


def test_every_command_line_option_has_help_and_defaults_are_said():
    from nemo_dcr.cli.main import build_parser
    from nemo_dcr.codec.names import DEFAULT_LEVEL
    p = build_parser()
    sub = next(a for a in p._actions if a.__class__.__name__ == "_SubParsersAction")
    missing = []
    for cmd, sp in sub.choices.items():
        for a in sp._actions:
            if a.help is None:
                missing.append(f"{cmd} {'/'.join(a.option_strings) or a.dest}")
            if a.dest == "level":
                assert f"default {DEFAULT_LEVEL}" in a.help, cmd
    assert not missing, f"options without help: {missing}"


def test_the_relay_commands_help_states_the_relays_own_defaults():
    """``nemo-dcr relay`` passes on only the options given (the relay's defaults apply to the
    rest, written once in transport/relay.py); its help says those defaults, checked here."""
    from nemo_dcr.cli.main import build_parser
    from nemo_dcr.transport.relay import Relay
    p = build_parser()
    sub = next(a for a in p._actions if a.__class__.__name__ == "_SubParsersAction")
    actions = {a.dest: a for a in sub.choices["relay"]._actions}
    params = inspect.signature(Relay.__init__).parameters
    said = {"poll_interval": f"default {params['poll_interval'].default:g}",
            "prune_delay": f"default {params['prune_delay'].default:g}",
            "cache_max_bytes": f"default {params['cache_max_bytes'].default >> 30} GiB"}
    for dest, text in said.items():
        assert actions[dest].default is None and text in actions[dest].help, (dest, actions[dest].help)
    args = p.parse_args(["relay", "--listen", "127.0.0.1:0", "--upstream", "/tmp/x", "--prune-delay", "0.2"])
    assert (args.prune_delay, args.poll_interval, args.cache_max_bytes) == (0.2, None, None)


def _markdown_files():
    """README.md, csrc/README.md and docs/*.md."""
    docs = os.path.join(ROOT, "docs")
    return [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "csrc", "README.md")] + sorted(
        os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))


def _cells(row: str) -> int:
    return row.strip().strip("|").replace("\\|", "").count("|") + 1  # ``\|``: a pipe inside a cell


def test_every_table_in_the_docs_has_a_header_row():
    """A table's separator row (``|---|...``) follows its header row, with as many cells: one
    pasted from a benchmark's output without its header renders as a run of text (the reload
    table of docs/results.md did, from 2026-12-06 19:14 to the next turn), and so does one whose
    header has more cells than its separator (two entropy tables whose column names held an
    unescaped ``|``)."""
    sep = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")
    bad = []
    for path in _markdown_files():
        lines = open(path).read().splitlines()
        fence = False
        for i, line in enumerate(lines):
            if line.startswith("```"):
                fence = not fence
            if fence or not sep.match(line):
                continue
            head = lines[i - 1] if i else ""
            if not head.startswith("|") or sep.match(head) or _cells(head) != _cells(line):
                bad.append(f"{os.path.relpath(path, ROOT)}:{i + 1}")
    assert not bad, f"tables without a header row of as many cells: {', '.join(bad)}"
