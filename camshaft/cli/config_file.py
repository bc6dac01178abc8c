"""`camshaft --config FILE COMMAND ...`: option values from a TOML file, a table per command ([build],
[bench.throughput]) of its flags without the dashes; the flags typed on the command line win. configs/ holds presets."""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup, TyperOption

from camshaft.errors import RequestError


def read_defaults(path: Path, root: TyperGroup) -> dict[str, Any]:
    """The file's values as the default_map for `root`, every section, key and value checked against the command
    it names (a typo anywhere is an error, not a setting silently ignored)."""
    try:
        table = _read(path)
    except FileNotFoundError:
        raise RequestError(f"--config {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RequestError(f"--config {path}: cannot read it ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise RequestError(f"--config {path} is not valid TOML: {exc}") from None
    return _group_defaults(root, table, path, ())


def _read(path: Path) -> dict[str, Any]:
    return tomllib.loads(path.read_text(encoding="utf-8-sig"))  # a byte-order mark (Windows editors) allowed


def _group_defaults(group: TyperGroup, table: dict[str, Any], path: Path, trail: tuple[str, ...]) -> dict[str, Any]:
    defaults: dict[str, Any] = {}
    for key, value in table.items():
        command = group.commands.get(key)
        if command is None or command.hidden:
            names = sorted(n for n, c in group.commands.items() if not c.hidden)
            what = f"a table [{_section(trail + (key,))}]" if isinstance(value, dict) else f"{key} = ..."
            raise RequestError(f"--config {path}: {what} names no camshaft {'command' if not trail else 'subcommand'}"
                               f"{_of(trail)}; its sections are the commands{_of(trail)}: {', '.join(names)}"
                               f"{_near(key, names)}")
        if not isinstance(value, dict):
            raise RequestError(f"--config {path}: {key} must be a table ([{_section(trail + (key,))}]) of that "
                               f"command's options, got {value!r:.60}")
        where = trail + (key,)
        defaults[key] = (_group_defaults(command, value, path, where) if isinstance(command, TyperGroup)
                         else _command_defaults(command, value, path, where))
    return defaults


def _command_defaults(command: TyperCommand, table: dict[str, Any], path: Path,
                      trail: tuple[str, ...]) -> dict[str, Any]:
    options = {_flag(p): p for p in command.params
               if isinstance(p, TyperOption) and p.expose_value and not p.is_eager and _flag(p)}
    ctx = typer.Context(command, info_name=trail[-1])
    defaults: dict[str, Any] = {}
    for key, value in table.items():
        param = options.get(key)
        if param is None:
            hint = f"; did you mean {key.replace('_', '-')}?" if key.replace("_", "-") in options else \
                _near(key, list(options))
            raise RequestError(f"--config {path}: [{_section(trail)}] has {key!r}, not an option of `camshaft "
                               f"{' '.join(trail)}`{hint} (its options: {', '.join(sorted(options))})")
        where = f"--config {path}: [{_section(trail)}] {key} = {value!r:.60}"
        value = _as_typed(param, value, where)
        try:
            param.process_value(ctx, value)
        except typer.BadParameter as exc:
            raise RequestError(f"{where}: {exc.format_message()}") from None
        defaults[param.name] = value  # type: ignore[index]
    return defaults


def _as_typed(param: TyperOption, value: Any, where: str) -> Any:
    """The value as the command line would give it: true/false for a flag, else a string or number (a list of them
    where the flag repeats); anything else TOML has (tables, dates, nested lists) would otherwise reach the command as
    its Python text. A path's ~ is the home directory, as the shell makes it."""
    if param.is_bool_flag:
        if not isinstance(value, bool):
            raise RequestError(f"{where}: a flag takes true or false")
        return value
    values = value if param.multiple and isinstance(value, list) else [value]
    if isinstance(value, list) and not param.multiple:
        raise RequestError(f"{where}: takes one value, not a list")
    for item in values:
        if isinstance(item, bool) or not isinstance(item, str | int | float):
            raise RequestError(f"{where}: takes {'strings or numbers' if param.multiple else 'a string or a number'}"
                               f", not {type(item).__name__}")
    if getattr(param.type_descriptor, "is_path", False):
        values = [os.path.expanduser(v) if isinstance(v, str) else v for v in values]
    return values if param.multiple else values[0]


def _flag(param: TyperOption) -> str | None:
    """The option's flag as the file spells it: --max-seq-len -> max-seq-len (of --stream/--no-stream: stream)."""
    return next((o[2:] for o in param.opts if o.startswith("--")), None)


def _section(trail: tuple[str, ...]) -> str:
    return ".".join(trail)


def _of(trail: tuple[str, ...]) -> str:
    return f" of `camshaft {' '.join(trail)}`" if trail else ""


def _near(key: str, names: list[str]) -> str:
    close = difflib.get_close_matches(key, names, n=1)
    return f"; did you mean {close[0]}?" if close else ""


def config_note(message: str, argv: list[str], root: TyperGroup) -> str:
    """Where an error names flags the command line did not type (nor the environment give) but the --config file's
    table for the command set, that said (" (--system is set by FILE [run])"), else "": the user is told to drop a
    flag they never typed."""
    words = [part for word in argv for part in (word.split("=", 1) if word.startswith("--config=") else [word])]
    if "--config" not in words[:-1]:
        return ""
    at = len(words) - 1 - words[::-1].index("--config")  # the last one given: the one click applies
    path, rest = words[at + 1], words[at + 2:]
    command: Any = root
    trail: list[str] = []
    for word in rest:  # the subcommands named, not the arguments after them (models fetch NAME)
        if not isinstance(command, TyperGroup) or word not in command.commands:
            break
        command = command.commands[word]
        trail.append(word)
    try:
        table: Any = _read(Path(path))
        for name in trail:
            table = table.get(name, {})
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, AttributeError):
        return ""
    typed = {word.split("=", 1)[0] for word in rest if word.startswith("--")}
    typed |= {f"--{_flag(p)}" for p in getattr(command, "params", ()) if isinstance(p, TyperOption)
              and isinstance(p.envvar, str) and os.environ.get(p.envvar)}  # $CAMSHAFT_API_KEY (set, not empty) wins
    named = dict.fromkeys(re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*)", message))
    set_there = [f"--{key}" for key in named if f"--{key}" not in typed and isinstance(table, dict) and key in table]
    if not set_there:
        return ""
    verb = "is" if len(set_there) == 1 else "are"
    return f" ({', '.join(set_there)} {verb} set by {path} [{_section(tuple(trail))}])"
