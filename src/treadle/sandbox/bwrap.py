"""The `isolated` placement's options and the bubblewrap command line that builds the box.

`Isolated` is a plain value (what `session.to(...)` records); `box_command` turns it into the
argv that runs one shell command in a fresh box: `prlimit` sets the resource limits, `bwrap`
unshares every namespace (user, PID, IPC, UTS, cgroup and, unless asked, network), mounts the
system directories read-only, the workspace read-write at `/workspace` and a private `/tmp`, and
kills everything in the box when it exits (`--die-with-parent` on the box's PID 1). This module
only computes values and looks executables up on `PATH`: it must never start a process.
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

from treadle.errors import ConfigurationError, SandboxUnavailable

log = logging.getLogger(__name__)

__all__ = [
    "BOX_ENV",
    "BOX_WORKSPACE",
    "BWRAP_INSTALL_HINT",
    "SYSTEM_DIRS",
    "Isolated",
    "ResourceLimits",
    "box_command",
    "find_executable",
]

#: Where the workspace appears inside the box (the commands' working directory).
BOX_WORKSPACE = "/workspace"
#: Host directories mounted read-only in every box (those that exist; links stay links).
SYSTEM_DIRS: tuple[str, ...] = (
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc",
)  # fmt: skip
#: The whole environment a boxed command starts with: nothing of the host's passes in.
BOX_ENV: Mapping[str, str] = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
}
#: What to tell a user whose machine has no `bwrap`.
BWRAP_INSTALL_HINT = (
    "install the 'bubblewrap' package (Debian/Ubuntu: `sudo apt-get install -y bubblewrap`; "
    "Fedora: `sudo dnf install bubblewrap`; Arch: `sudo pacman -S bubblewrap`). The isolated "
    "backend needs Linux; it does not run on macOS or Windows"
)
#: Processes bubblewrap itself keeps in the box's count (its monitor and the box's PID 1).
_BWRAP_OWN_PROCESSES = 2
_LIMIT_NAMES = (
    "cpu_seconds", "memory_bytes", "max_processes", "file_size_bytes", "open_files", "tmp_bytes",
)  # fmt: skip
_SPEC_KEYS = ("network", "read_only", "writable", "limits", "env")


def _spec_object(value: object, what: str) -> Mapping[str, Any]:
    """`value` as a JSON object (string keys); else ConfigurationError naming `what`."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigurationError(f"{what} must be a JSON object, got {type(value).__name__}.")
    return value


def _exact_keys(value: Mapping[str, Any], keys: tuple[str, ...], what: str) -> None:
    # Strict both ways: a key this version does not know could be a limit it would drop.
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise ConfigurationError(f"{what} has unknown key(s) {', '.join(unknown)}.")
    missing = [k for k in keys if k not in value]
    if missing:
        raise ConfigurationError(f"{what} is missing key(s) {', '.join(missing)}.")


def _spec_paths(value: object, what: str) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        raise ConfigurationError(f"{what} must be a list of absolute paths.")
    return tuple(value)  # each path is checked by Isolated.__post_init__


@dataclass(frozen=True, slots=True)
class ResourceLimits:
    """Per-command limits (rlimits, inherited by every process in the box); None means no limit."""

    cpu_seconds: int | None = 60
    """CPU time per process (SIGXCPU, then SIGKILL)."""
    memory_bytes: int | None = 2 * 1024**3
    """Address space per process (`RLIMIT_AS`): allocations beyond it fail."""
    max_processes: int | None = 256
    """Processes (and threads) the box may run at once; forks beyond it fail."""
    file_size_bytes: int | None = 1024**3
    """Largest file a process may write (SIGXFSZ beyond it)."""
    open_files: int | None = 1024
    """Open file descriptors per process."""
    tmp_bytes: int | None = 256 * 1024**2
    """Size of the box's private `/tmp`, and of its `/dev/shm` (each a tmpfs, held in memory)."""

    def __post_init__(self) -> None:
        for name in _LIMIT_NAMES:
            value = getattr(self, name)
            bad = isinstance(value, bool) or not isinstance(value, int) or value <= 0
            if value is not None and bad:
                raise ConfigurationError(
                    f"ResourceLimits.{name} must be a positive integer or None, got {value!r}."
                )


@dataclass(frozen=True, slots=True)
class Isolated:
    """The `isolated` placement: `session.to(Isolated(network=True))`; `.to("isolated")` is
    `Isolated()`. Each sandbox is a fresh temporary workspace, deleted on close."""

    placement: ClassVar[str] = "isolated"
    """The placement name recorded on sessions and in saved files (`to_spec` holds the options)."""

    network: bool = False
    """Share the host's network (loopback included); off by default."""
    read_only: tuple[str, ...] = ()
    """Extra host paths mounted read-only at the same path inside the box."""
    writable: tuple[str, ...] = ()
    """Extra host paths mounted read-write at the same path inside the box."""
    limits: ResourceLimits = field(default_factory=ResourceLimits)
    """Resource limits for every command."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables added to `BOX_ENV` (the only way to hand a boxed command a value)."""

    def __post_init__(self) -> None:
        for kind, paths in (("read_only", self.read_only), ("writable", self.writable)):
            if isinstance(paths, str):
                raise ConfigurationError(f"Isolated.{kind} takes a tuple of paths, not one string.")
            for path in paths:
                if not isinstance(path, str) or not os.path.isabs(path):
                    raise ConfigurationError(
                        f"Isolated.{kind} paths must be absolute host paths, got {path!r}."
                    )
                if path in ("/", BOX_WORKSPACE) or path.startswith(("/proc", "/dev")):
                    raise ConfigurationError(
                        f"Isolated.{kind} cannot mount {path!r}: it would replace part of the box."
                    )
        if not isinstance(self.network, bool):
            raise ConfigurationError(
                f"Isolated.network must be true or false, got {self.network!r}."
            )
        if not isinstance(self.limits, ResourceLimits):
            raise ConfigurationError("Isolated.limits must be a ResourceLimits(...) value.")
        if not isinstance(self.env, Mapping):
            raise ConfigurationError("Isolated.env must be a mapping of names to strings.")
        for name, value in self.env.items():
            if not isinstance(name, str) or not name or "=" in name or "\0" in name:
                raise ConfigurationError(
                    "Isolated.env names must be non-empty strings without '=' or NUL, "
                    f"got {name!r}."
                )
            if not isinstance(value, str) or "\0" in value:
                raise ConfigurationError(
                    f"Isolated.env values must be strings without NUL, got {value!r} for {name}."
                )

    def to_spec(self) -> dict[str, Any]:
        """The options as plain JSON data (env values included): `Isolated.from_spec` reverses it.

        Saved session files keep only the env names (see `treadle.persist`); distributed workers
        get the whole spec.
        """
        return {
            "network": self.network,
            "read_only": list(self.read_only),
            "writable": list(self.writable),
            "limits": {name: getattr(self.limits, name) for name in _LIMIT_NAMES},
            "env": dict(self.env),
        }

    @classmethod
    def from_spec(cls, spec: object) -> Isolated:
        """The options from `to_spec` output; `ConfigurationError` for anything else.

        Every key must be present and known (a spec from a newer Treadle with a limit this version
        does not know is refused, never half-applied); values pass the constructors' checks.
        """
        data = _spec_object(spec, "an Isolated spec")
        _exact_keys(data, _SPEC_KEYS, "the Isolated spec")
        limits = _spec_object(data["limits"], "Isolated spec limits")
        _exact_keys(limits, _LIMIT_NAMES, "the Isolated spec limits")
        env = _spec_object(data["env"], "Isolated spec env")
        return cls(
            network=data["network"],
            read_only=_spec_paths(data["read_only"], "Isolated spec read_only"),
            writable=_spec_paths(data["writable"], "Isolated spec writable"),
            limits=ResourceLimits(**limits),
            env=dict(env),
        )


def find_executable(name: str) -> str:
    """The absolute path of `name` on `PATH`; `SandboxUnavailable` with the install hint if none."""
    found = shutil.which(name)
    if found is None:
        package = "bubblewrap" if name == "bwrap" else "util-linux"
        hint = BWRAP_INSTALL_HINT if name == "bwrap" else f"install the '{package}' package"
        raise SandboxUnavailable(
            f"the isolated sandbox needs `{name}`, which is not on PATH; {hint}."
        )
    return found


@cache
def _system_mounts() -> tuple[str, ...]:
    """bwrap arguments mounting `SYSTEM_DIRS`: merged-/usr links are recreated as links."""
    args: list[str] = []
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return tuple(args)


def _prlimit_args(limits: ResourceLimits, processes_already: int) -> list[str]:
    args: list[str] = []
    if limits.cpu_seconds is not None:
        # The hard limit a second later: SIGXCPU (which says why) comes before SIGKILL.
        soft = _within_hard("cpu_seconds", resource.RLIMIT_CPU, limits.cpu_seconds)
        hard = _within_hard("cpu_seconds", resource.RLIMIT_CPU, limits.cpu_seconds + 1)
        args.append(f"--cpu={min(soft, hard)}:{hard}")
    pairs = (
        ("as", "memory_bytes", resource.RLIMIT_AS, limits.memory_bytes),
        ("fsize", "file_size_bytes", resource.RLIMIT_FSIZE, limits.file_size_bytes),
        ("nofile", "open_files", resource.RLIMIT_NOFILE, limits.open_files),
    )
    for flag, name, which, value in pairs:
        if value is not None:
            value = _within_hard(name, which, value)
            args.append(f"--{flag}={value}:{value}")
    if limits.max_processes is not None:
        # RLIMIT_NPROC counts every process of the box's host uid, bubblewrap's own included.
        n = limits.max_processes + _BWRAP_OWN_PROCESSES + processes_already
        n = _within_hard("max_processes", resource.RLIMIT_NPROC, n)
        args.append(f"--nproc={n}:{n}")
    return args


_warned: set[tuple[str, int, int]] = set()


def _within_hard(name: str, which: int, value: int) -> int:
    """`value`, or this process's hard limit when that is lower: a process cannot raise a hard
    limit without CAP_SYS_RESOURCE, and `prlimit` would then fail every command with its own
    error as the command's output (a shell's `ulimit -n 64` before starting the harness).
    The box gets the lower limit and a warning says so, once."""
    hard = resource.getrlimit(which)[1]
    if hard == resource.RLIM_INFINITY or value <= hard:
        return value
    if (name, value, hard) not in _warned:
        _warned.add((name, value, hard))
        log.warning(
            "treadle: the isolated box's limits.%s is %d, above this process's hard limit %d; "
            "the box gets %d (raise the hard limit, e.g. `ulimit -H`, to give it more)",
            name, value, hard, hard,
        )  # fmt: skip
    return hard


def box_command(
    options: Isolated,
    *,
    workspace: Path,
    bwrap: str,
    prlimit: str,
    processes_already: int = 0,
) -> list[str]:
    """The argv prefix that runs a command (appended after it) in a box over `workspace`.

    `processes_already` is how many processes the box's host uid runs already (0 when the box
    has a uid of its own), so the process limit counts only the box's.
    """
    args = [prlimit, *_prlimit_args(options.limits, processes_already), "--", bwrap]
    # bwrap's own init is the box's PID 1 (not the shell: as PID 1 it would ignore SIGXCPU and
    # every other signal it has no handler for). When the shell exits, the kernel kills the rest.
    args += ["--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent"]
    if options.network:
        args.append("--share-net")
    args += ["--cap-drop", "ALL", "--uid", "1000", "--gid", "1000", "--hostname", "box"]
    args += _system_mounts()
    args += ["--proc", "/proc", "--dev", "/dev"]
    # Every RAM-backed mount the box can write is sized: /tmp and /dev/shm get `tmp_bytes` each;
    # the root and /dev tmpfs that bwrap builds are made read-only once everything is mounted.
    for where in ("/dev/shm", "/tmp"):  # before the extra mounts, so a path under /tmp can be one
        if options.limits.tmp_bytes is not None:
            args += ["--size", str(options.limits.tmp_bytes)]
        args += ["--tmpfs", where]
    for path in options.read_only:
        args += ["--ro-bind", path, path]
    for path in options.writable:
        args += ["--bind", path, path]
    args += ["--bind", str(workspace), BOX_WORKSPACE, "--chdir", BOX_WORKSPACE]
    args += ["--remount-ro", "/dev", "--remount-ro", "/"]
    return args
