"""MkDocs hook: the config field tables of the method pages, generated from the dataclasses.

A page line ``<!-- config-fields: trl_prime.PrimeRLOOConfig -->`` is replaced by a Markdown table of every field
trl-prime adds to that config (name, default, help text) followed by the TRL / transformers fields whose default it
changes. The tables therefore cannot drift from the code; ``tests/docs/test_docs.py`` checks the pages use them.
"""

from __future__ import annotations

import dataclasses
import html
import importlib
import re


MARKER = re.compile(r"^<!-- config-fields: ([\w.]+) -->$", re.M)


def _load(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def upstream_base(cls):
    """The first TRL / transformers dataclass in ``cls``'s MRO (the config trl-prime extends)."""
    return next(b for b in cls.__mro__ if b.__module__.split(".")[0] in ("trl", "transformers"))


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "required"


def _cell(text: str) -> str:
    """One table cell of help text: Markdown and HTML in it are shown literally (``<extra_0>``, ``beta * x``), its
    `code spans` stay code."""
    parts = " ".join(str(text).split()).split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        parts[i] = html.escape(parts[i], quote=False).replace("*", "\\*").replace("_", "\\_")
    return "`".join(parts).replace("|", "\\|")


def config_fields(cls) -> tuple[list[dataclasses.Field], list[tuple[dataclasses.Field, object]]]:
    """``(added, changed)``: the fields trl-prime adds, and ``(field, upstream default)`` of those it re-defaults."""
    base = {f.name: f for f in dataclasses.fields(upstream_base(cls))}
    added = [f for f in dataclasses.fields(cls) if f.name not in base]
    changed = [
        (f, _default(base[f.name]))
        for f in dataclasses.fields(cls)
        if f.name in base and _default(f) != _default(base[f.name])
    ]
    return added, changed


def config_table(path: str) -> str:
    cls = _load(path)
    added, changed = config_fields(cls)
    base = upstream_base(cls)
    lines = [
        f"Fields `{cls.__name__}` adds to TRL's `{base.__name__}` (generated from the dataclass):",
        "",
        "| field | default | meaning |",
        "|---|---|---|",
    ]
    lines += [f"| `{f.name}` | `{_default(f)!r}` | {_cell(f.metadata.get('help', ''))} |" for f in added]
    if changed:
        lines += [
            "",
            f"Fields of `{base.__name__}` whose default `{cls.__name__}` changes:",
            "",
            f"| field | default | `{base.__name__}`'s default | meaning |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| `{f.name}` | `{_default(f)!r}` | `{up!r}` | {_cell(f.metadata.get('help', ''))} |" for f, up in changed
        ]
    return "\n".join(lines)


def render(markdown: str) -> str:
    return MARKER.sub(lambda m: config_table(m.group(1)), markdown)


def on_page_markdown(markdown, page, config, files, **kwargs):
    return render(markdown)
