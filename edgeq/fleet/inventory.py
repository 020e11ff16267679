"""The device inventory: ``devices.toml``, or YAML in the shape of an Ansible inventory.

TOML::

    [defaults]
    user = "pi"
    known_hosts = "~/.ssh/known_hosts"

    [devices.pi4-desk]
    host = "192.168.1.20"
    identity_file = "~/.ssh/id_ed25519"   # omit to use the SSH agent
    python = "/usr/bin/python3"           # the device's interpreter
    venv = "~/edgeq/venv"                 # optional: bootstrap a virtualenv here
    workdir = "~/edgeq"                   # everything edgeq writes stays under it
    tags = ["pi4"]

YAML (Ansible): ``all.hosts.NAME.ansible_host`` / ``ansible_port`` / ``ansible_user`` /
``ansible_ssh_private_key_file`` / ``ansible_python_interpreter`` plus ``edgeq_*`` keys
for the rest; group names (``all.children.GROUP``) become tags.

Passwords are refused: keys or the agent only.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from edgeq.errors import InventoryError, MissingExtraError

log = logging.getLogger(__name__)

DEFAULT_INVENTORY = "devices.toml"
INVENTORY_ENV = "EDGEQ_INVENTORY"
HOST_KEY_POLICIES = ("strict", "accept-new")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_SECRET_KEYS = ("password", "passphrase", "ansible_password", "ansible_ssh_pass", "ansible_ssh_password")

FIELDS = {
    "host",
    "port",
    "user",
    "identity_file",
    "agent",
    "python",
    "venv",
    "runtime",
    "workdir",
    "tags",
    "known_hosts",
    "host_key_policy",
    "online",
    "wheelhouse",
    "connect_timeout",
}


@dataclass(frozen=True)
class Device:
    """One device as the inventory describes it."""

    name: str
    host: str
    port: int = 22
    user: str | None = None
    identity_file: str | None = None  # a private key on this host; None: the agent
    agent: bool = True
    python: str = "python3"
    venv: str | None = None  # bootstrap a virtualenv here and run edgeq from it
    runtime: str | None = None  # force a LiteRT backend on the device (--runtime)
    workdir: str = "~/edgeq"
    tags: tuple[str, ...] = ()
    known_hosts: str | None = None  # extra known_hosts file (the user's is always read)
    host_key_policy: str = "strict"  # or "accept-new": record an unknown key, refuse a changed one
    online: bool = False  # may pip reach PyPI from the device? (default: push the wheels)
    # where the dependency wheels go on the device (default WORKDIR/wheels): devices that name
    # the same folder (an NFS share, or accounts of one machine) get them uploaded once
    wheelhouse: str | None = None
    connect_timeout: float = 15.0

    @property
    def address(self) -> str:
        who = f"{self.user}@" if self.user else ""
        return f"{who}{self.host}:{self.port}"


@dataclass(frozen=True)
class Inventory:
    path: Path | None
    devices: tuple[Device, ...] = field(default_factory=tuple)

    def names(self) -> list[str]:
        return [d.name for d in self.devices]

    def get(self, name: str) -> Device:
        for device in self.devices:
            if device.name == name:
                return device
        raise InventoryError(f"no device {name!r} in {self.path}; known: {', '.join(self.names()) or 'none'}")

    def select(self, target: str | Iterable[str]) -> list[Device]:
        """Devices for ``NAME[,NAME...]``, ``tag:X`` or ``all`` (several may be combined)."""
        parts = [target] if isinstance(target, str) else list(target)
        words = [w.strip() for part in parts for w in str(part).split(",") if w.strip()]
        if not words:
            raise InventoryError("no device given: name one, or use tag:NAME or all")
        chosen: list[Device] = []
        for word in words:
            if word == "all":
                found = list(self.devices)
            elif word.startswith("tag:"):
                tag = word[4:]
                found = [d for d in self.devices if tag in d.tags]
                if not found:
                    known = sorted({t for d in self.devices for t in d.tags})
                    raise InventoryError(
                        f"no device has tag {tag!r} in {self.path}; tags: {', '.join(known) or 'none'}"
                    )
            else:
                found = [self.get(word)]
            chosen += [d for d in found if d not in chosen]
        if not chosen:
            raise InventoryError(f"{self.path} lists no devices")
        return chosen


def find_inventory(path: str | os.PathLike | None = None) -> Path:
    """The inventory to use: ``path``, else $EDGEQ_INVENTORY, else ./devices.toml."""
    candidate = path or os.environ.get(INVENTORY_ENV) or DEFAULT_INVENTORY
    p = Path(candidate).expanduser()
    if not p.is_file():
        raise InventoryError(
            f"{p}: no inventory file; write one (see deploy/devices.example.toml) or pass --inventory PATH"
        )
    return p


def load_inventory(path: str | os.PathLike | None = None) -> Inventory:
    """Read a TOML or YAML inventory and validate every device in it."""
    p = find_inventory(path)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InventoryError(
            f"{p}: not a text file (byte {exc.start} is not UTF-8); give a TOML or YAML inventory"
        ) from exc
    if p.suffix.lower() in (".yml", ".yaml"):
        raw = _from_ansible(_load_yaml(text, p), p)
    else:
        raw = _from_toml(text, p)
    devices = tuple(_device(name, values, p) for name, values in raw)
    if not devices:
        raise InventoryError(f"{p}: no devices in it")
    names = [d.name for d in devices]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise InventoryError(f"{p}: device names appear twice: {', '.join(dup)}")
    return Inventory(path=p, devices=devices)


def _load_toml(text: str, path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError as exc:
            raise MissingExtraError(
                "reading devices.toml on Python < 3.11 needs tomli: pip install 'edgeq[deploy]'"
            ) from exc
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InventoryError(f"{path}: not valid TOML ({' '.join(str(exc).split())})") from exc


def _from_toml(text: str, path: Path) -> list[tuple[str, dict[str, Any]]]:
    data = _load_toml(text, path)
    unknown = set(data) - {"defaults", "devices"}
    if unknown:
        raise InventoryError(
            f"{path}: unknown top-level table(s) {', '.join(sorted(unknown))}; use [defaults], [devices.NAME]"
        )
    defaults = data.get("defaults", {})
    devices = data.get("devices", {})
    if not isinstance(defaults, dict) or not isinstance(devices, dict):
        raise InventoryError(f"{path}: [defaults] and [devices.NAME] must be tables")
    out = []
    for name, values in devices.items():
        if not isinstance(values, dict):
            raise InventoryError(f"{path}: [devices.{name}] must be a table")
        out.append((name, {**defaults, **values}))
    return out


def _load_yaml(text: str, path: Path) -> Any:
    try:
        import yaml
    except ImportError as exc:
        raise MissingExtraError(f"{path}: YAML inventories need PyYAML: pip install 'edgeq[deploy]'") from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise InventoryError(f"{path}: not valid YAML: {' '.join(str(problem).split())}{where}") from exc


_ANSIBLE_KEYS = {
    "ansible_host": "host",
    "ansible_port": "port",
    "ansible_user": "user",
    "ansible_ssh_private_key_file": "identity_file",
    "ansible_python_interpreter": "python",
}


def _from_ansible(data: Any, path: Path) -> list[tuple[str, dict[str, Any]]]:
    """Flatten an Ansible YAML inventory: group vars, then host vars; groups become tags."""
    if not isinstance(data, dict):
        raise InventoryError(f"{path}: expected an Ansible inventory (a mapping with 'all:')")
    hosts: dict[str, dict[str, Any]] = {}
    tags: dict[str, list[str]] = {}

    def walk(group_name: str, group: Any, inherited: dict[str, Any]) -> None:
        group = group or {}
        if not isinstance(group, dict):
            raise InventoryError(f"{path}: group {group_name!r} must be a mapping")

        def mapping(value: Any, what: str) -> dict:
            value = value or {}
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                raise InventoryError(f"{path}: {what} must be a mapping of names to settings")
            return value

        variables = {**inherited, **mapping(group.get("vars"), f"vars of group {group_name!r}")}
        for host, host_vars in mapping(group.get("hosts"), f"hosts of group {group_name!r}").items():
            merged = hosts.setdefault(host, {})
            for key, value in variables.items():
                merged.setdefault(key, value)
            merged.update(mapping(host_vars, f"host {host!r}"))
            if group_name not in ("all", "ungrouped"):
                tags.setdefault(host, [])
                if group_name not in tags[host]:
                    tags[host].append(group_name)
        for child, child_group in mapping(group.get("children"), f"children of group {group_name!r}").items():
            walk(child, child_group, variables)

    if not all(isinstance(k, str) for k in data):
        raise InventoryError(f"{path}: expected an Ansible inventory (a mapping with 'all:')")
    groups = data if "all" not in data else {"all": data["all"]}
    for name, group in groups.items():
        walk(name, group, {})
    out = []
    for host, values in hosts.items():
        converted: dict[str, Any] = {}
        for key, value in values.items():
            if key in _SECRET_KEYS:
                converted[key] = value
            elif key in _ANSIBLE_KEYS:
                converted[_ANSIBLE_KEYS[key]] = value
            elif key.startswith("edgeq_"):
                converted[key[len("edgeq_") :]] = value
            else:
                log.info("%s: %s: ignoring Ansible variable %s", path, host, key)
        converted.setdefault("host", host)
        converted["tags"] = list(converted.get("tags", [])) + tags.get(host, [])
        out.append((host, converted))
    return out


def _device(name: str, values: dict[str, Any], path: Path) -> Device:
    where = f"{path}: device {name!r}"
    if not _NAME.match(str(name)):
        raise InventoryError(f"{where}: names may use letters, digits, '.', '_' and '-' (they become folder names)")
    secrets = [k for k in values if k in _SECRET_KEYS]
    if secrets:
        raise InventoryError(
            f"{where}: '{secrets[0]}' is not allowed: edgeq never stores passwords; "
            "use identity_file = a private key, or the SSH agent"
        )
    unknown = set(values) - FIELDS
    if unknown:
        raise InventoryError(
            f"{where}: unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(FIELDS))}"
        )
    if not values.get("host"):
        raise InventoryError(f"{where}: 'host' is required")
    kwargs = dict(values)
    kwargs["tags"] = tuple(str(t) for t in (values.get("tags") or ()))
    try:
        kwargs["port"] = int(values.get("port", 22))
        kwargs["connect_timeout"] = float(values.get("connect_timeout", 15.0))
    except (TypeError, ValueError):
        raise InventoryError(f"{where}: port and connect_timeout must be numbers") from None
    policy = kwargs.get("host_key_policy", "strict")
    if policy not in HOST_KEY_POLICIES:
        raise InventoryError(f"{where}: host_key_policy {policy!r}: use one of {', '.join(HOST_KEY_POLICIES)}")
    workdir = str(kwargs.get("workdir", "~/edgeq"))
    if not (workdir.startswith("/") or workdir.startswith("~/") or workdir == "~"):
        raise InventoryError(f"{where}: workdir {workdir!r} must be absolute or start with ~/")
    if ".." in workdir.split("/") or workdir.rstrip("/") in ("", "~", "/"):
        raise InventoryError(f"{where}: workdir {workdir!r}: give a folder of its own, e.g. ~/edgeq")
    wheelhouse = kwargs.get("wheelhouse")
    if wheelhouse is not None:
        wheelhouse = str(wheelhouse)
        if not (wheelhouse.startswith("/") or wheelhouse.startswith("~/")) or ".." in wheelhouse.split("/"):
            raise InventoryError(f"{where}: wheelhouse {wheelhouse!r} must be an absolute folder or start with ~/")
        if wheelhouse.rstrip("/") in ("", "~", "/"):
            raise InventoryError(f"{where}: wheelhouse {wheelhouse!r}: give a folder of its own, e.g. ~/edgeq-wheels")
        kwargs["wheelhouse"] = wheelhouse
    for key in ("identity_file", "known_hosts"):
        if kwargs.get(key):
            kwargs[key] = str(Path(str(kwargs[key])).expanduser())
    return Device(name=str(name), **kwargs)


def with_policy(devices: list[Device], policy: str | None) -> list[Device]:
    """Apply a command-line host-key policy (e.g. --accept-new-host-keys) to the devices."""
    if not policy:
        return devices
    return [replace(d, host_key_policy=policy) for d in devices]
