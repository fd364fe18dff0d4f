"""docs/cli.md documents every option of every verb, as `--help` lists it, and nothing else.

Options are read from the help records click prints for ``--help`` (so a flag pair such as
``--verify / --no-verify`` counts as two options); the page's options are the first cells of the
tables under each ``## `prep VERB` `` heading.
"""

from __future__ import annotations

import pathlib
import re

import click
import pytest

from prep.cli import main

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "cli.md"
OPTION = re.compile(r"(?<![\w-])(--?[a-zA-Z][\w-]*)")
HELP = {"-h", "--help"}  # every verb has them; the page documents them once, under `prep`


def help_options(cmd: click.Command, ctx: click.Context) -> set[str]:
    """The option names ``cmd --help`` prints (first column of its Options list)."""
    names = set()
    for param in cmd.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is not None:
            names |= set(OPTION.findall(_names_only(record[0])))
    return names


def _names_only(first_column: str) -> str:
    # "-o, --out OUT" / "--layout [a|b]" / "--verify / --no-verify": drop the metavar and choices.
    return " ".join(w for w in re.split(r"[ ,/]+", first_column) if w.startswith("-"))


def documented() -> dict[str, set[str]]:
    """Per section (``prep`` or the verb), the options named in its tables' first cells."""
    sections: dict[str, set[str]] = {}
    current = None
    for line in DOC.read_text().splitlines():
        heading = re.match(r"^## `prep(?: (\w+))?`\s*$", line)
        if heading:
            current = heading.group(1) or "prep"
            sections[current] = set()
        elif current and line.startswith("| `"):
            sections[current] |= set(OPTION.findall(line.split("|")[1]))
    return sections


def commands() -> dict[str, tuple[click.Command, click.Context]]:
    root = click.Context(main, info_name="prep", **main.context_settings)
    out = {"prep": (main, root)}
    for name, cmd in main.commands.items():
        out[name] = (cmd, click.Context(cmd, info_name=name, parent=root))
    return out


def test_every_verb_has_a_section_and_no_section_names_a_missing_verb():
    assert set(documented()) == set(commands())


@pytest.mark.parametrize("verb", sorted(commands()))
def test_every_option_of_the_verb_is_documented_and_no_other(verb):
    cmd, ctx = commands()[verb]
    real, doc = help_options(cmd, ctx), documented()[verb]
    want = real if verb == "prep" else real - HELP
    assert want - doc == set(), f"docs/cli.md, `prep {verb}`: options missing from the page"
    assert doc - want == set(), f"docs/cli.md, `prep {verb}`: documents options the verb does not have"
    assert HELP <= help_options(cmd, ctx)  # documented once under `prep` as every verb's


def test_the_help_records_are_read_as_the_user_sees_them():
    cmd, ctx = commands()["revert"]
    assert help_options(cmd, ctx) == {"-o", "--dest", "--force", "--verify", "--no-verify", "--json", "-q",
                                      "--quiet", "-h", "--help"}


@pytest.mark.parametrize("verb", sorted(commands()))
def test_every_choice_an_option_takes_is_named_in_its_row(verb):
    # An option whose values are a fixed list (click.Choice: --layout, --moe-layout, --engine, ...)
    # names each of them in its row of the page: a layout or engine added to the registry shows up
    # in --help at once, and must not be missing from the page a user reads. A row that points to
    # another option's ("As for `prep run`", "`--gemm` for A only") may leave them to that row.
    rows: dict[str, list[str]] = {}  # option -> its rows, in every section
    own: dict[str, str] = {}  # option -> its row in this verb's section
    current = None
    for line in DOC.read_text().splitlines():
        heading = re.match(r"^## `prep(?: (\w+))?`\s*$", line)
        if heading:
            current = heading.group(1) or "prep"
        elif current and line.startswith("| `"):
            for name in OPTION.findall(line.split("|")[1]):
                rows.setdefault(name, []).append(line)
                if current == verb:
                    own[name] = line
    cmd, ctx = commands()[verb]
    missing = []
    for param in cmd.get_params(ctx):
        if isinstance(param, click.Option) and isinstance(param.type, click.Choice):
            row = next((own[o] for o in param.opts if o in own), "")
            said = row.split("|")[2].strip() if row.count("|") > 2 else ""
            pointed = (OPTION.findall(row.split("|")[1]) if said.startswith("As for")
                       else OPTION.findall(said.split(" for ")[0]) if re.match(r"`--[\w-]+` for ", said) else [])
            text = row + "".join(r for o in pointed for r in rows.get(o, ()) if r != row)
            missing += [f"{param.opts[-1]} {c}" for c in param.type.choices if f"`{c}`" not in text]
    assert not missing, f"docs/cli.md, `prep {verb}`: choices not named in their option's row: {missing}"
