"""The one pydantic-settings configuration of gputopo's commands: flags and GPUTOPO_* variables, flags win."""

from __future__ import annotations

from pydantic_settings import SettingsConfigDict

ENV_PREFIX = "GPUTOPO_"


def command_settings(prog: str) -> SettingsConfigDict:
    """Settings parsed by pydantic-settings itself from kebab-case flags and the environment."""
    return SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="ignore",
        frozen=True,
        cli_prog_name=prog,
        cli_kebab_case=True,
        cli_implicit_flags=True,  # --device-plugin / --no-device-plugin
        cli_hide_none_type=True,
        # A bad flag is reported by main() like every other invalid setting (exit 2), not by argparse's exit.
        cli_exit_on_error=False,
    )
