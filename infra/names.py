"""Names Google Cloud accepts, as regular expressions: one source for the stack configuration
(``infra.stack_config``) and the Kubernetes objects (``infra.k8s.base``). README, "Deploying".
"""

from __future__ import annotations

import re

__all__ = ["PROJECT_ID_RE", "REGION_RE", "ZONE_RE"]

PROJECT_ID_RE = re.compile(r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")
"""A Google Cloud project id: 6-30 lower-case letters, digits and '-', starting with a letter, not ending
with '-' (cloud.google.com/resource-manager/docs/creating-managing-projects, "Project ID")."""

REGION_RE = re.compile(r"^[a-z]+-[a-z]+[0-9]+$")
"""A region such as ``us-central1`` or ``europe-west4`` (cloud.google.com/compute/docs/regions-zones)."""

ZONE_RE = re.compile(r"^([a-z]+-[a-z]+[0-9]+)-[a-z]$")
"""A zone such as ``us-central1-a``: its region, '-', one letter (group 1 is the region)."""
