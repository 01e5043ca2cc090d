"""``rslurm submit``: render an sbatch template into one concrete batch script and submit it.

Who calls what, in order:

1. :func:`add_parser` registers ``submit`` on the CLI (:func:`resilient_slurm.cli.build_parser`). Its
   arguments are taken raw: sbatch options are open-ended, so argparse cannot know them.
2. ``main`` calls :func:`cmd_submit`, which runs :func:`parse_submit_args` (own options, sbatch options,
   ``--`` and the command) and :func:`find_template` (a shipped name or a file).
3. :func:`render` makes the script: options given replace the template's ``#SBATCH`` lines of the
   same name and the others are added after its last ``#SBATCH`` line (sbatch stops reading
   directives at the first command); ``--grace`` sets the ``@<seconds>`` of ``--signal``;
   ``--local-dir`` and ``--durable`` replace the ``RSLURM_LOCAL_DIR`` and ``RSLURM_DURABLE`` lines;
   the command, shell-quoted, replaces the template's ``set -- "$@"`` line.
4. ``--dry-run`` prints the script and stops. Otherwise the script is written to the script directory
   (``./rslurm-jobs`` unless ``--script-dir``) and submitted with ``sbatch --parsable`` through the
   :class:`~resilient_slurm.slurm.SlurmClient`; the job id goes to stdout.

Exit codes: 0 submitted (or printed); 1 sbatch failed (its message is shown); 2 bad arguments or a bad
template. Standard library only, like ``rslurm launch``: no torch import.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from . import config
from .errors import ConfigError, SlurmError
from .paths import describe_path

TEMPLATE_SUFFIX = ".sbatch"
DEFAULT_SCRIPT_DIR = "rslurm-jobs"
COMMAND_LINE = 'set -- "$@"'  # the template line the command replaces
SUBMIT_TIMEOUT_S = 60.0

# sbatch options (Slurm 22.05 and later): long name -> (short letter, how it takes a value). "value":
# required (``--nodes=2``, ``--nodes 2``, ``-N2``, ``-N 2``); "optional": only as ``--name=value``;
# "flag": none. Options missing here are passed on as given (``--name=value`` or ``--name``).
_OPTIONS: dict[str, tuple[str, str]] = {
    "account": ("A", "value"), "acctg-freq": ("", "value"), "array": ("a", "value"), "batch": ("", "value"),
    "bb": ("", "value"), "bbf": ("", "value"), "begin": ("b", "value"), "chdir": ("D", "value"),
    "cluster-constraint": ("", "value"), "clusters": ("M", "value"), "comment": ("", "value"),
    "constraint": ("C", "value"), "container": ("", "value"), "contiguous": ("", "flag"),
    "core-spec": ("S", "value"), "cores-per-socket": ("", "value"), "cpu-freq": ("", "value"),
    "cpus-per-gpu": ("", "value"), "cpus-per-task": ("c", "value"), "deadline": ("", "value"),
    "delay-boot": ("", "value"), "dependency": ("d", "value"), "distribution": ("m", "value"),
    "error": ("e", "value"), "exclude": ("x", "value"), "exclusive": ("", "optional"),
    "export": ("", "optional"), "export-file": ("", "value"), "extra-node-info": ("B", "value"),
    "get-user-env": ("", "optional"), "gid": ("", "value"), "gpu-bind": ("", "value"),
    "gpu-freq": ("", "value"), "gpus": ("G", "value"), "gpus-per-node": ("", "value"),
    "gpus-per-socket": ("", "value"), "gpus-per-task": ("", "value"), "gres": ("", "value"),
    "gres-flags": ("", "value"), "hint": ("", "value"), "hold": ("H", "flag"), "ignore-pbs": ("", "flag"),
    "input": ("i", "value"), "job-name": ("J", "value"), "kill-on-invalid-dep": ("", "value"),
    "licenses": ("L", "value"), "mail-type": ("", "value"), "mail-user": ("", "value"),
    "mcs-label": ("", "value"), "mem": ("", "value"), "mem-bind": ("", "value"),
    "mem-per-cpu": ("", "value"), "mem-per-gpu": ("", "value"), "mincpus": ("", "value"),
    "network": ("", "value"), "nice": ("", "optional"), "no-kill": ("k", "flag"), "no-requeue": ("", "flag"),
    "nodefile": ("F", "value"), "nodelist": ("w", "value"), "nodes": ("N", "value"),
    "ntasks": ("n", "value"), "ntasks-per-core": ("", "value"), "ntasks-per-gpu": ("", "value"),
    "ntasks-per-node": ("", "value"), "ntasks-per-socket": ("", "value"), "open-mode": ("", "value"),
    "output": ("o", "value"), "overcommit": ("O", "flag"), "oversubscribe": ("s", "flag"),
    "partition": ("p", "value"), "power": ("", "value"), "prefer": ("", "value"),
    "priority": ("", "value"), "profile": ("", "value"), "propagate": ("", "optional"),
    "qos": ("q", "value"), "quiet": ("Q", "flag"), "reboot": ("", "flag"), "requeue": ("", "flag"),
    "reservation": ("", "value"), "signal": ("", "value"), "sockets-per-node": ("", "value"),
    "spread-job": ("", "flag"), "switches": ("", "value"), "thread-spec": ("", "value"),
    "threads-per-core": ("", "value"), "time": ("t", "value"), "time-min": ("", "value"),
    "tmp": ("", "value"), "tres-per-task": ("", "value"), "uid": ("", "value"),
    "use-min-nodes": ("", "flag"), "verbose": ("v", "flag"), "wckey": ("", "value"),
}
_SHORT = {short: name for name, (short, _) in _OPTIONS.items() if short}
# Options that make no sense for a rendered script (or that rslurm submit gives itself), with what to do.
_REFUSED = {
    "wrap": "the template is the batch script; give the command after `--`",
    "parsable": "rslurm submit passes it to sbatch itself and prints only the job id",
    "test-only": "use --dry-run to see the script, or run `sbatch --test-only` on a written script",
    "wait": "run `sbatch --wait` on the script that rslurm submit writes",
    "help": "", "usage": "", "version": "",
}
# Options that exclude each other: giving one removes the template's lines of the other.
_OPPOSITES = {"requeue": "no-requeue", "no-requeue": "requeue"}

USAGE = "rslurm submit --template NAME|FILE [options] [sbatch options] [--dry-run] -- CMD [ARGS...]"


@dataclass(frozen=True)
class Directive:
    """One sbatch option: its long name and its value (None for a flag)."""

    name: str
    value: str | None = None

    def text(self) -> str:
        """The option as an ``#SBATCH`` line writes it, quoted for sbatch's directive parser."""
        if self.value is None:
            return f"--{self.name}"
        return f"--{self.name}={_quote_directive_value(self.value)}"


@dataclass(frozen=True)
class SubmitRequest:
    """What ``rslurm submit`` was asked to do, after parsing."""

    template: str | None
    command: tuple[str, ...] = ()
    options: tuple[Directive, ...] = ()
    grace: int | None = None
    local_dir: str | None = None
    durable: str | None = None
    script_dir: str = DEFAULT_SCRIPT_DIR
    dry_run: bool = False
    list_templates: bool = False
    help: bool = False
    argv: tuple[str, ...] = field(default=(), compare=False)


# --------------------------------------------------------------------------------------------- templates
def template_dirs() -> list[Path]:
    """Where shipped templates are looked up: package data (``resilient_slurm/sbatch_templates``, for a
    wheel that ships them there), then the source tree's ``sbatch_templates/`` (editable installs)."""
    dirs: list[Path] = []
    try:
        packaged = Path(str(resources.files("resilient_slurm") / "sbatch_templates"))
        dirs.append(packaged)
    except (ModuleNotFoundError, TypeError):
        pass
    dirs.append(Path(__file__).resolve().parent.parent / "sbatch_templates")
    return [d for d in dirs if d.is_dir()]


def shipped_templates() -> dict[str, Path]:
    """Shipped template names (file names without ``.sbatch``) and their files; the first directory wins."""
    found: dict[str, Path] = {}
    for d in template_dirs():
        for f in sorted(d.glob(f"*{TEMPLATE_SUFFIX}")):
            found.setdefault(f.name[: -len(TEMPLATE_SUFFIX)], f)
    return found


def find_template(name: str) -> Path:
    """A shipped template by name (``single_node``), or a template file by path."""
    shipped = shipped_templates()
    key = name[: -len(TEMPLATE_SUFFIX)] if name.endswith(TEMPLATE_SUFFIX) else name
    if key in shipped and os.sep not in name:
        return shipped[key]
    if os.sep in name or os.path.exists(name):
        path = Path(name).expanduser()
        if not path.is_file():
            what = "does not exist" if not os.path.lexists(path) else f"is {describe_path(str(path))}, not a regular file"
            raise ConfigError(f"rslurm submit: template file {name} {what}")
        return path
    names = ", ".join(shipped) or "(none found: is sbatch_templates/ installed?)"
    raise ConfigError(f"rslurm submit: unknown template {name!r}; shipped templates: {names} "
                      "(or give the path to a template file)")


# --------------------------------------------------------------------------------------------- parsing
def canonical_name(name: str) -> str:
    """The long sbatch option ``name`` stands for: itself, or the only known option it abbreviates (as
    sbatch's getopt_long allows); unknown names are kept as they are."""
    if name in _OPTIONS or name in _REFUSED:
        return name
    matches = [n for n in _OPTIONS if n.startswith(name)]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise ConfigError(f"rslurm submit: --{name} is ambiguous: could be --{', --'.join(matches)}")
    return name


def parse_sbatch_options(tokens: Sequence[str], *, where: str) -> list[Directive]:
    """Parse sbatch options (``--name=value``, ``--name value``, ``-N2``, ``-N 2``, flags) into
    directives with long names. ``where`` names the source in errors (command line, a template line)."""
    out: list[Directive] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        i += 1
        if tok.startswith("--") and len(tok) > 2:
            raw, eq, value = tok[2:].partition("=")
            name = canonical_name(raw)
            if name in _REFUSED:
                hint = _REFUSED[name]
                raise ConfigError(f"rslurm submit: --{name} is not supported{': ' + hint if hint else ''}")
            kind = _OPTIONS.get(name, ("", "unknown"))[1]
            if eq:
                if kind == "flag":
                    raise ConfigError(f"rslurm submit: --{name} takes no value ({where}: {tok!r})")
                out.append(Directive(name, value))
            elif kind == "value":
                if i >= len(tokens):
                    raise ConfigError(f"rslurm submit: --{name} needs a value ({where})")
                out.append(Directive(name, tokens[i]))
                i += 1
            else:
                out.append(Directive(name))
        elif tok.startswith("-") and len(tok) > 1 and tok[1] != "-":
            letter = tok[1]
            if letter not in _SHORT:
                raise ConfigError(f"rslurm submit: unknown option {tok!r} ({where}); long sbatch options not "
                                  "known to rslurm pass through as --name=value")
            name = _SHORT[letter]
            if _OPTIONS[name][1] == "flag":
                if len(tok) > 2:
                    raise ConfigError(f"rslurm submit: -{letter} takes no value; give flags one by one ({tok!r})")
                out.append(Directive(name))
            elif len(tok) > 2:
                out.append(Directive(name, tok[2:].removeprefix("=")))
            else:
                if i >= len(tokens):
                    raise ConfigError(f"rslurm submit: -{letter} (--{name}) needs a value ({where})")
                out.append(Directive(name, tokens[i]))
                i += 1
        else:
            raise ConfigError(f"rslurm submit: unexpected argument {tok!r} ({where}); the command goes after "
                              f"`--`, and sbatch options unknown to rslurm are written --name=value; usage: {USAGE}")
    return out


_OWN_WITH_VALUE = ("--template", "--grace", "--local-dir", "--durable", "--script-dir")
_OWN_FLAGS = ("--dry-run", "--list", "--help", "-h")


def parse_submit_args(argv: Sequence[str]) -> SubmitRequest:
    """Split ``argv`` into rslurm submit's options, sbatch options and the command after ``--``."""
    argv = list(argv)
    if "--" in argv:
        cut = argv.index("--")
        before, command = argv[:cut], argv[cut + 1:]
    else:
        before, command = argv, None
    own: dict[str, str] = {}
    flags: set[str] = set()
    rest: list[str] = []
    i = 0
    while i < len(before):
        tok = before[i]
        i += 1
        name, eq, value = tok.partition("=")
        if name in _OWN_WITH_VALUE:
            if not eq:
                if i >= len(before):
                    raise ConfigError(f"rslurm submit: {name} needs a value; usage: {USAGE}")
                value = before[i]
                i += 1
            own[name] = value
        elif tok in _OWN_FLAGS:
            flags.add("--help" if tok == "-h" else tok)
        else:
            rest.append(tok)
    if "--help" in flags:
        return SubmitRequest(template=None, help=True)
    if "--list" in flags:
        return SubmitRequest(template=None, list_templates=True)
    options = parse_sbatch_options(rest, where="command line")
    if "--template" not in own:
        raise ConfigError(f"rslurm submit: --template is required (one of: {', '.join(shipped_templates())}, "
                          f"or a file); usage: {USAGE}")
    if command is None:
        raise ConfigError(f"rslurm submit: no command: put the training command after `--`; usage: {USAGE}")
    if not command:
        raise ConfigError(f"rslurm submit: the command after `--` is empty; usage: {USAGE}")
    grace = None
    if "--grace" in own:
        try:
            grace = int(own["--grace"])
        except ValueError:
            grace = -1
        if grace <= 0:
            raise ConfigError(f"rslurm submit: --grace must be a positive whole number of seconds, got "
                              f"{own['--grace']!r}")
        if any(d.name == "signal" for d in options):
            raise ConfigError("rslurm submit: give either --grace SECONDS or --signal=..., not both (--grace "
                              "sets the @SECONDS of the template's --signal=B:USR1@SECONDS)")
    for key in ("--local-dir", "--durable", "--script-dir", "--template"):
        if key in own and not own[key]:
            raise ConfigError(f"rslurm submit: {key} needs a non-empty value")
    return SubmitRequest(template=own["--template"], command=tuple(command), options=tuple(options),
                         grace=grace, local_dir=own.get("--local-dir"), durable=own.get("--durable"),
                         script_dir=own.get("--script-dir", DEFAULT_SCRIPT_DIR), dry_run="--dry-run" in flags,
                         argv=tuple(argv))


# --------------------------------------------------------------------------------------------- rendering
def _quote_directive_value(value: str) -> str:
    # sbatch's directive parser splits on whitespace, treats an unquoted `#` as the start of a comment and
    # understands double quotes and backslash escapes.
    if value and not re.search(r'[\s#"\\]', value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def split_directive(rest: str) -> tuple[list[str], str]:
    """Split the text after ``#SBATCH`` like sbatch does: whitespace-separated arguments, double quotes
    and backslashes honoured, an unquoted ``#`` starts a comment. Returns (arguments, comment)."""
    args: list[str] = []
    cur: list[str] | None = None
    quoted = False
    i = 0
    while i < len(rest):
        c = rest[i]
        if c == "\\" and i + 1 < len(rest):
            cur = (cur or []) + [rest[i + 1]]
            i += 2
            continue
        if c == '"':
            quoted = not quoted
            cur = cur or []
        elif c == "#" and not quoted:
            if cur is not None:
                args.append("".join(cur))
            return args, rest[i:]
        elif c.isspace() and not quoted:
            if cur is not None:
                args.append("".join(cur))
                cur = None
        else:
            cur = (cur or []) + [c]
        i += 1
    if cur is not None:
        args.append("".join(cur))
    return args, ""


def _directive_line(directives: Sequence[Directive], comment: str, width: int) -> str:
    body = "#SBATCH " + " ".join(d.text() for d in directives)
    if not comment:
        return body
    return f"{body:<{max(width, len(body) + 1)}}{comment}"


def _with_grace(value: str | None, grace: int) -> str:
    if not value:
        return f"B:USR1@{grace}"
    return re.sub(r"@\d+$", "", value) + f"@{grace}"


def _time_seconds(value: str) -> int | None:
    """sbatch --time in seconds: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS; None if unknown."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", value.strip())
    if not m:
        return None
    nums = [int(g) for g in m.group(2, 3, 4) if g is not None]
    if m.group(1) is not None:
        hours, minutes, seconds = (nums + [0, 0])[:3]
        return int(m.group(1)) * 86400 + hours * 3600 + minutes * 60 + seconds
    if len(nums) == 3:
        return nums[0] * 3600 + nums[1] * 60 + nums[2]
    if len(nums) == 2:
        return nums[0] * 60 + nums[1]
    return nums[0] * 60


def _setting_line(lines: list[str], var: str, value: str, before: int) -> int:
    """Replace the template's ``[export] VAR=...`` line, or add ``export VAR=...`` at ``before``; returns
    how many lines were added."""
    pattern = re.compile(rf"^(\s*)(export\s+)?{var}=")
    new = f"export {var}={shlex.quote(value)}  # given to rslurm submit"
    for i, line in enumerate(lines):
        m = pattern.match(line)
        if m:
            lines[i] = m.group(1) + new
            return 0
    lines.insert(before, new)
    return 1


def render(template_text: str, request: SubmitRequest, *, source: str = "template") -> str:
    """The concrete batch script for ``request`` (see the module docstring for the rules)."""
    lines = template_text.splitlines()
    if not lines or not lines[0].startswith("#!"):
        raise ConfigError(f"rslurm submit: {source} does not start with a `#!` line (sbatch needs one)")
    command_at = [i for i, line in enumerate(lines) if line.strip() == COMMAND_LINE]
    if len(command_at) != 1:
        raise ConfigError(f"rslurm submit: {source} must have exactly one line `{COMMAND_LINE}` (where the "
                          f"command goes); found {len(command_at)}")
    # sbatch reads #SBATCH lines only up to the first command of the script.
    header_end = next((i for i, line in enumerate(lines) if i > 0 and line.strip()
                       and not line.lstrip().startswith("#")), len(lines))
    given: dict[str, list[Directive]] = {}
    for d in request.options:
        given.setdefault(d.name, []).append(d)
    if request.grace is not None:
        template_signal = None
        for i in range(1, header_end):
            if lines[i].startswith("#SBATCH"):
                found = [d for d in parse_sbatch_options(split_directive(lines[i][7:])[0], where=f"{source} "
                                                         f"line {i + 1}") if d.name == "signal"]
                template_signal = found[-1].value if found else template_signal
        given["signal"] = [Directive("signal", _with_grace(template_signal, request.grace))]
    dropped = {_OPPOSITES[n] for n in given if n in _OPPOSITES}
    placed: set[str] = set()
    final: dict[str, str | None] = {}
    last_directive = 0
    out = list(lines)
    for i in range(1, header_end):
        line = lines[i]
        if not line.startswith("#SBATCH"):
            continue
        last_directive = i
        args, comment = split_directive(line[7:])
        directives = parse_sbatch_options(args, where=f"{source} line {i + 1}")
        kept: list[Directive] = []
        changed = False
        for d in directives:
            if d.name in given:
                changed = True
                if d.name not in placed:
                    kept.extend(given[d.name])
                    placed.add(d.name)
            elif d.name in dropped:
                changed = True
            else:
                kept.append(d)
        if changed:
            width = len(line) - len(comment) if comment else 0
            if kept:
                out[i] = _directive_line(kept, comment, width)
            else:
                out[i] = "##SBATCH " + " ".join(d.text() for d in directives) + "  # replaced: see rslurm submit"
        for d in kept:
            final[d.name] = d.value
    extra = [d for name, ds in given.items() if name not in placed for d in ds]
    for d in extra:
        final[d.name] = d.value
    insert_at = (last_directive or _end_of_leading_comments(lines, header_end)) + 1
    if extra:
        out[insert_at:insert_at] = ["# given to rslurm submit:", *(_directive_line([d], "", 0) for d in extra)]
    _check_grace(final)
    # Settings and the command live after the header; indices there moved by the inserted lines.
    shift = len(out) - len(lines)
    cmd_index = command_at[0] + shift
    out[cmd_index] = "set -- " + shlex.join(request.command)
    for var, value in (("RSLURM_LOCAL_DIR", request.local_dir), ("RSLURM_DURABLE", request.durable)):
        if value is not None:
            cmd_index += _setting_line(out, var, value, cmd_index)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    origin = [f"# Rendered by `rslurm submit` from {source} on {stamp}:"]
    if request.argv:
        cut = request.argv.index("--") if "--" in request.argv else len(request.argv)
        shown = [a for a in request.argv[:cut] if a != "--dry-run"] + list(request.argv[cut:])
        origin.append("#   rslurm submit " + shlex.join(shown).replace("\n", " "))
    out[1:1] = origin
    return "\n".join(out) + "\n"


def _end_of_leading_comments(lines: Sequence[str], header_end: int) -> int:
    i = 0
    while i + 1 < header_end and lines[i + 1].lstrip().startswith("#"):
        i += 1
    return i


def _check_grace(final: dict[str, str | None]) -> None:
    sig, limit = final.get("signal"), final.get("time")
    if not sig or not limit:
        return
    m = re.search(r"@(\d+)$", sig)
    seconds = _time_seconds(limit)
    if m and seconds is not None and int(m.group(1)) >= seconds:
        raise ConfigError(f"rslurm submit: the signal comes {m.group(1)} s before the time limit, but --time="
                          f"{limit} is only {seconds} s: the job would be asked to stop as soon as it starts. "
                          "Give a longer --time or a shorter --grace")


# --------------------------------------------------------------------------------------------- submitting
def write_script(text: str, script_dir: str, template_name: str) -> Path:
    """Write the rendered script under ``script_dir`` with a new, unique name; returns its path."""
    d = Path(script_dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"rslurm submit: cannot create the script directory {d}: {exc.strerror or exc}") from exc
    stem = f"{template_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    for n in range(1000):
        path = d / (f"{stem}{TEMPLATE_SUFFIX}" if n == 0 else f"{stem}.{n}{TEMPLATE_SUFFIX}")
        try:
            with open(path, "x") as f:
                f.write(text)
            return path.resolve()
        except FileExistsError:
            continue
        except OSError as exc:
            raise ConfigError(f"rslurm submit: cannot write {path}: {exc.strerror or exc}") from exc
    raise ConfigError(f"rslurm submit: no free script name {stem}.N{TEMPLATE_SUFFIX} in {d}")


def _help_text() -> str:
    names = ", ".join(shipped_templates()) or "(none found)"
    return f"""usage: {USAGE}

Render an sbatch template into one batch script and submit it with `sbatch --parsable`; print the job id.
The script runs CMD under the launcher (`exec rslurm launch -- srun ... CMD`).

options:
  --template NAME|FILE  a shipped template ({names}) or a template file
  --grace SECONDS       seconds between the launcher's USR1 and the time limit (--signal=B:USR1@SECONDS)
  --local-dir DIR       node-local checkpoint root, %n = node name (RSLURM_LOCAL_DIR in the script)
  --durable URL         durable tier: /path or s3://bucket/prefix (RSLURM_DURABLE in the script)
  --script-dir DIR      where rendered scripts are written (default: ./{DEFAULT_SCRIPT_DIR})
  --dry-run             print the script; write and submit nothing
  --list                list the shipped templates
  -h, --help            show this help

Every other option before `--` is an sbatch option (--nodes/-N, --time/-t, --partition/-p, --gres,
--job-name/-J, ...): it replaces the template's #SBATCH line of the same name, or is added.
Exit codes: 0 submitted, 1 sbatch failed (its message is shown), 2 bad arguments or template.
See sbatch_templates/README.md.
"""


def cmd_submit(args: argparse.Namespace) -> int:
    """``rslurm submit``: parse, render, then print (``--dry-run``) or write and submit."""
    argv = list(args.submit_args)
    request = parse_submit_args(argv)
    if request.help:
        print(_help_text(), end="")
        return 0
    if request.list_templates:
        for name, path in shipped_templates().items():
            print(f"{name:<24} {path}")
        return 0
    assert request.template is not None
    path = find_template(request.template)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"rslurm submit: cannot read template {path}: {exc}") from exc
    script = render(text, request, source=str(path))
    if request.dry_run:
        sys.stdout.write(script)
        return 0
    name = path.name[: -len(TEMPLATE_SUFFIX)] if path.name.endswith(TEMPLATE_SUFFIX) else path.stem
    written = write_script(script, request.script_dir, name)
    from .slurm import slurm_client

    backend = config.resolve(["slurm_backend"], {}, config_path=getattr(args, "config", None))["slurm_backend"]
    try:
        job_id = slurm_client(backend, timeout=SUBMIT_TIMEOUT_S).submit(written)
    except SlurmError as exc:
        print(f"rslurm submit: sbatch failed; the script is kept in {written}\n{exc}", file=sys.stderr)
        return 1
    print(job_id)
    print(f"rslurm submit: job {job_id} submitted ({written})", file=sys.stderr)
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``rslurm submit`` on the CLI's sub-parsers (called by :func:`resilient_slurm.cli.build_parser`)."""
    # Every argument is taken as it comes ('+' prefix: argparse sees no options) and parsed by
    # parse_submit_args, since sbatch options cannot be listed to argparse in advance.
    sp: argparse.ArgumentParser = sub.add_parser(
        "submit", help="render an sbatch template and submit it (rslurm submit --help)", prefix_chars="+",
        add_help=False, usage=USAGE)
    sp.add_argument("submit_args", nargs=argparse.REMAINDER)
    sp.set_defaults(func=cmd_submit)
    return sp
