"""Every check `edge-agent run` makes before it connects, for `run`, `config check` and
`doctor` alike: the config file itself, then what it points at. A failure is one `ConfigError`
that names the config file and the key, and what is wrong with the file or value it names:

    agent.toml: mqtt.password_file: /etc/edge-agent/mqtt.password: not found
    agent.toml: metrics.listen: port 99999 is not 0-65535 (expected HOST:PORT, e.g. 127.0.0.1:9100)
"""

from __future__ import annotations

import shutil
from pathlib import Path

from agent.core.config import AgentConfig, FirmwareSection, load_config
from agent.core.errors import ConfigError, EdgeAgentError


def preflight(path: str | Path, *, broker: str | None = None) -> AgentConfig:
    """Load the config at `path` and check what it points at; `broker` as `run --broker`."""
    config = load_config(path)
    source = str(path)
    from agent.service.files import check_private_file

    m = config.mqtt
    ident = config.identity if config.agent.role == "worker" else None
    secrets = [("mqtt.password_file", m.password_file), ("mqtt.tls_key", m.tls_key)]
    if ident is not None:
        secrets += [("identity.claim_password_file", ident.claim_password_file),
                    ("identity.token_file", ident.token_file)]
        for key, file in (("identity.claim_ca", ident.claim_ca), ("mqtt.tls_ca", m.tls_ca)):
            if file and not Path(file).is_file():
                raise ConfigError(source, key, f"{file}: not found")
    for key, file in secrets:
        if file:
            try:
                check_private_file(file, what="file")
            except ConfigError as exc:
                raise ConfigError(source, key, f"{file}: {exc.reason}") from None
    url = broker or m.url
    if not url.startswith("memory://"):
        from agent.transport.probe import broker_address

        try:
            broker_address(url)
        except ConfigError as exc:
            raise ConfigError("--broker" if broker else source, None if broker else "mqtt.url", exc.reason) from None
        if url.startswith("mqtts://") or m.tls_ca or m.tls_cert:
            from agent.transport import TlsSettings

            try:
                TlsSettings(ca_file=m.tls_ca, cert_file=m.tls_cert, key_file=m.tls_key).context()
            except ConfigError as exc:
                named = getattr(m, exc.key, "") if exc.key else ""
                raise ConfigError(source, f"mqtt.{exc.key}" if exc.key else "mqtt",
                                  f"{named}: {exc.reason}" if named else exc.reason) from None
    if config.metrics.listen:
        from agent.service.healthhttp import parse_listen

        try:
            parse_listen(config.metrics.listen)  # the rule the health endpoint applies when it starts
        except ConfigError as exc:
            raise ConfigError(source, "metrics.listen", exc.reason) from None
    fw = config.firmware
    if fw.public_key:
        try:
            from rollout_engine.keys import load_verify_key

            load_verify_key(fw.public_key)
        except (EdgeAgentError, OSError, ValueError) as exc:
            text = str(exc)
            raise ConfigError(source, "firmware.public_key",
                              text if fw.public_key in text else f"{fw.public_key}: {text}") from None
    if fw.public_key and fw.trust_root:
        raise ConfigError(source, "firmware.trust_root", "one of public_key (one pinned key) and trust_root (the"
                                                         " trust document's root), not both")
    if fw.trust_document and not fw.trust_root:
        raise ConfigError(source, "firmware.trust_document", "needs trust_root: the root key that signed it")
    if fw.trust_root:
        from rollout_engine.keys import load_verify_key
        from rollout_engine.trust import TrustedKeys, read_trust_document

        try:
            root = load_verify_key(fw.trust_root)
        except EdgeAgentError as exc:
            raise ConfigError(source, "firmware.trust_root", str(exc)) from None
        if fw.trust_document:
            try:
                TrustedKeys([root], now_ms=lambda: 0).accept(read_trust_document(fw.trust_document))
            except EdgeAgentError as exc:
                raise ConfigError(source, "firmware.trust_document", f"{fw.trust_document}: {exc}") from None
    for key, argv in (("firmware.reboot_command", fw.reboot_command), ("firmware.health_command", fw.health_command)):
        if argv and shutil.which(argv[0]) is None:
            raise ConfigError(source, key, f"{argv[0]!r} is not an executable on PATH (give its full path)")
    _check_installer(config, source)
    _check_apps(config, source)
    _check_artifact_server(config, source)
    _check_config_targets(config, source)
    return config


def _check_config_targets(config: AgentConfig, source: str) -> None:
    """Each `[config_targets.NAME]` names commands on PATH and a folder it can write (or make),
    and has the fleet's key to check a release with."""
    import os

    for name, target in sorted(config.config_targets.items()):
        key = f"config_targets.{name}"
        if not config.firmware.keyed:
            raise ConfigError(source, "firmware.public_key", f"required by [{key}] (or firmware.trust_root): a"
                                                             " config release is checked with the fleet's key")
        for field in ("validate_command", "apply_command", "health_command"):
            argv = getattr(target, field)
            if argv and shutil.which(argv[0]) is None:
                raise ConfigError(source, f"{key}.{field}", f"{argv[0]!r} is not an executable on PATH "
                                                            "(give its full path)")
        from config_rollout.device.apply import owner_ids
        from config_rollout.errors import ConfigReleaseError

        try:
            owner_ids(target)
        except ConfigReleaseError as exc:
            raise ConfigError(source, f"{key}.{'owner' if 'user' in str(exc) else 'group'}", str(exc)) from None
        folder = Path(target.directory)
        existing = folder if folder.exists() else folder.parent
        if not existing.is_dir():
            raise ConfigError(source, f"{key}.directory", f"{folder}: neither it nor its parent is a folder")
        if not os.access(existing, os.W_OK | os.X_OK):  # (a release is staged in the agent's own state)
            raise ConfigError(source, f"{key}.directory", f"{folder}: the agent cannot write there"
                                                          + ("" if existing == folder else " (to make the folder)"))


def _check_artifact_server(config: AgentConfig, source: str) -> None:
    """A leader's `[artifacts]` TLS files load (the server would fail its start on them)."""
    if config.agent.role != "leader" or not config.artifacts.listen:
        return
    from agent.service.files import artifact_tls

    artifact_tls(config, source=source)


def _check_installer(config: AgentConfig, source: str) -> None:
    """The installer's table decodes and keeps its rules, and names tools on PATH and files that
    are there: a first rollout must not be where a device finds out. Only the named backend's
    module is loaded, and none for a worker that updates nothing."""
    fw = config.firmware
    if not fw.keyed and fw.installer == FirmwareSection().installer and fw.installer_settings is None:
        return
    from firmware_rollout.device.backends import configured_backend

    backend = configured_backend(fw, source=source)  # the table's own rules
    if not fw.keyed:
        return
    if fw.helper_socket:  # the backend's tools and devices are the helper's (its own config checks them)
        helper = Path(fw.helper_socket)
        if not helper.is_socket():
            raise ConfigError(source, "firmware.helper_socket", f"{helper}: no socket there (is "
                                                               "edge-agent-installer.socket enabled?)")
        return
    backend.preflight()


def _check_apps(config: AgentConfig, source: str) -> None:
    """A worker given the application helper's socket can take application offers: the fleet's
    key to check bundles with, and the socket there (its unit listening)."""
    apps = config.apps
    if config.agent.role != "worker" or not apps.helper_socket:
        return
    if not config.firmware.keyed:
        raise ConfigError(source, "apps.helper_socket", "applications are checked with the fleet's key: set"
                                                        " firmware.public_key or firmware.trust_root")
    if not Path(apps.helper_socket).is_socket():
        raise ConfigError(source, "apps.helper_socket", f"{apps.helper_socket}: no socket there (is"
                                                        " edge-agent-apps.socket enabled?)")


__all__ = ["preflight"]
