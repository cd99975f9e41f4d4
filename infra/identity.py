"""Who is acting, from the credentials this process holds: the actor of audit records.

``$USER`` (or ``$GPUMIGRATE_OPERATOR``) is a claim anyone can set. Where the process holds credentials
that a service vouches for, the audit records name that identity instead:

- ``aws-sts``: the ARN that STS ``GetCallerIdentity`` returns for boto3's credential chain (the call is
  answered by AWS itself, so the name is proved, not claimed);
- ``gcp``: the principal of the Google credentials in the ADC chain (a service account's email, or the
  account of gcloud's user credentials) — read from credentials this process can use, without a call;
- ``prefect``: the Prefect Cloud user behind ``PREFECT_API_KEY`` (``GET /me/`` on the Cloud API).

Each source is tried only where its credentials exist locally (no network probe otherwise), in the
order of ``$GPUMIGRATE_IDENTITY`` (default ``aws,gcp,prefect``; ``none`` turns the lookup off).
The core never imports a cloud SDK: the CLI and the flows install :func:`resolve_identity` with
``gpumigrate.settings.set_identity_resolver``. Credentials and tokens are never logged or returned.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from gpumigrate.settings import Identity

SOURCES_ENV = "GPUMIGRATE_IDENTITY"
DEFAULT_SOURCES = ("aws", "gcp", "prefect")
PREFECT_CLOUD_API = "https://api.prefect.cloud/api"
_TIMEOUT_S = 5.0
_log = logging.getLogger("gpumigrate.identity")


def aws_identity() -> Identity | None:
    """The STS caller identity of boto3's default chain (AWS_ENDPOINT_URL honoured), or None without credentials."""
    import boto3
    from botocore.config import Config

    session = boto3.session.Session()
    if session.get_credentials() is None:
        return None
    config = Config(connect_timeout=_TIMEOUT_S, read_timeout=_TIMEOUT_S, retries={"max_attempts": 2})
    sts = session.client("sts", region_name=session.region_name or "us-east-1", config=config)
    arn = sts.get_caller_identity()["Arn"]
    return Identity(str(arn), "aws-sts")


def _adc_file() -> Path | None:
    named = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if named:
        return Path(named)
    home = os.environ.get("CLOUDSDK_CONFIG") or str(Path.home() / ".config" / "gcloud")
    found = Path(home) / "application_default_credentials.json"
    return found if found.is_file() else None


def gcp_identity() -> Identity | None:
    """The principal of the ADC credentials, where a file names them (no metadata-server probe)."""
    if _adc_file() is None:
        return None
    import google.auth

    credentials, _ = google.auth.default()
    for attr in ("service_account_email", "account", "signer_email"):
        name = getattr(credentials, attr, None)
        if isinstance(name, str) and name and name != "default":
            return Identity(name, "gcp")
    return None


def prefect_identity() -> Identity | None:
    """The Prefect Cloud user of ``PREFECT_API_KEY`` (``$PREFECT_CLOUD_API_URL``/me/)."""
    api_key = os.environ.get("PREFECT_API_KEY")
    if not api_key:
        return None
    import httpx

    base = (os.environ.get("PREFECT_CLOUD_API_URL") or PREFECT_CLOUD_API).rstrip("/")
    with httpx.Client(timeout=_TIMEOUT_S, trust_env=False) as client:
        resp = client.get(f"{base}/me/", headers={"Authorization": f"Bearer {api_key}"})
    resp.raise_for_status()
    me = resp.json()
    name = me.get("handle") or me.get("email") if isinstance(me, dict) else None
    return Identity(str(name), "prefect") if name else None


SOURCES: dict[str, Callable[[], Identity | None]] = {
    "aws": aws_identity,
    "gcp": gcp_identity,
    "prefect": prefect_identity,
}


def sources_from_env() -> list[str]:
    spec = os.environ.get(SOURCES_ENV, "").strip()
    if spec == "none":
        return []
    names = [s.strip() for s in spec.split(",") if s.strip()] if spec else list(DEFAULT_SOURCES)
    return [n for n in names if n in SOURCES]


def resolve_identity(sources: Sequence[str] | None = None) -> Identity | None:
    """The first identity a source proves, in order; None where none does (the caller records ``$USER``).

    A source that fails (a service down, credentials rejected) is skipped with a warning naming the
    source and the error's type only: its message could carry request details."""
    for name in sources if sources is not None else sources_from_env():
        try:
            found = SOURCES[name]()
        except Exception as exc:
            _log.warning("identity source %s failed (%s); trying the next", name, type(exc).__name__)
            continue
        if found is not None:
            return found
    return None
