"""A code version's own Python packages: where they come from and how they are pinned.

Shared by the portal, which resolves a code version's declared requirements into a *lock*
at upload (:mod:`backend.projects.requirements`), and the agents, which build one
environment per lock (:mod:`worker.agent.environments`). Both call uv
(https://docs.astral.sh/uv/), the resolver and installer the `uv` wheel ships, with the
same index settings (docs/security.md, "Training code's own packages").

A lock is a requirements file of exact pins with hashes, one package per entry, holding
only what the platform's own environment lacks: torch and everything else the platform
ships stay the platform's, so a lock never names one of them.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, Field

# `name==version` at the start of a lock entry (PEP 503 names, PEP 440 versions).
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", re.MULTILINE)
# The default index: PyPI.
DEFAULT_INDEX_URL = "https://pypi.org/simple"


class PackageIndex(BaseModel):
    """Where uv looks for packages: `index_url` (default PyPI; empty: no index at all, only
    `find_links`), `extra_index_urls`, and `find_links` (a local folder of wheels, for an
    offline or mirrored site). With `wheels_only` (the default) no source distribution is
    accepted, so no package code runs while resolving or installing."""

    index_url: str = DEFAULT_INDEX_URL
    extra_index_urls: list[str] = Field(default_factory=list)
    find_links: str | None = None
    wheels_only: bool = True

    def uv_args(self) -> list[str]:
        """The uv options that select these indexes (for `uv pip install` and `compile`)."""
        args = ["--index-url", self.index_url] if self.index_url else ["--no-index"]
        for url in self.extra_index_urls:
            args += ["--extra-index-url", url]
        if self.find_links:
            args += ["--find-links", self.find_links]
        if self.wheels_only:
            args += ["--only-binary", ":all:"]
        return args

    def describe(self) -> str:
        """The indexes, as an error message names them."""
        parts = [_public(url) for url in (self.index_url, *self.extra_index_urls) if url]
        if self.find_links:
            parts.append(f"wheels in {self.find_links}")
        return ", ".join(parts) or "no index"


def _public(url: str) -> str:
    """`url` without the credentials a mirror's URL may carry (`https://user:token@host/`):
    errors that name an index reach users."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))


def uv_bin() -> str:
    """The uv executable the `uv` wheel installed beside this interpreter.

    Raises:
        FileNotFoundError: the `uv` package is not installed (it is a dependency of polytrain).
    """
    from uv import find_uv_bin

    return str(find_uv_bin())


def lock_hash(lock: str) -> str:
    """The hex sha256 that names a lock's environment on every agent."""
    return hashlib.sha256(lock.encode()).hexdigest()


def pins(lock: str) -> dict[str, str]:
    """`{normalised name: version}` of a lock's entries (PEP 503 names: lower case, `-`)."""
    return {normalise(name): version for name, version in PIN.findall(lock)}


def normalise(name: str) -> str:
    """A distribution name as PEP 503 compares them: `Torch_Optimizer` -> `torch-optimizer`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def platform_packages(site_packages: list[Path] | None = None) -> dict[str, str]:
    """`{normalised name: version}` of the distributions this interpreter's environment holds:
    what a lock must not name, since the platform provides it."""
    from importlib import metadata

    found = (
        metadata.distributions()
        if site_packages is None
        else metadata.distributions(path=[str(p) for p in site_packages])
    )
    return {normalise(d.metadata["Name"]): d.version for d in found if d.metadata["Name"]}


class PackageIndexSettings(BaseModel):
    """The index settings of the API and of each agent (environment `POLYTRAIN_INDEX_URL`,
    `POLYTRAIN_EXTRA_INDEX_URLS` (a JSON list), `POLYTRAIN_FIND_LINKS`,
    `POLYTRAIN_WHEELS_ONLY`): mixed into their pydantic-settings classes. docs/security.md,
    "Training code's own packages", says what trusting an index means."""

    index_url: str = Field(
        default=DEFAULT_INDEX_URL,
        description="the package index code versions' packages come from; empty: none (only "
        "the wheels in find_links, for a site with no index at all)",
    )
    extra_index_urls: list[str] = Field(default_factory=list, description="more indexes")
    find_links: str | None = Field(
        default=None, description="a folder of wheels (offline or mirrored sites)"
    )
    wheels_only: bool = Field(
        default=True, description="accept wheels only: no package code runs to build one"
    )

    def package_index(self) -> PackageIndex:
        """These settings as uv's index options."""
        return PackageIndex(
            index_url=self.index_url,
            extra_index_urls=self.extra_index_urls,
            find_links=self.find_links,
            wheels_only=self.wheels_only,
        )


class Environment(BaseModel):
    """A task's own packages, as the scheduler sends them to its agents: the lock (see the
    module's docstring) and the hash that names its cached environment."""

    lock_hash: str = Field(pattern=r"^[0-9a-f]{64}$")
    lock: str
