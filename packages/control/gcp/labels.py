"""How dtrain finds a cluster's resources in Compute Engine and Cloud Storage (infra/ keeps these
conventions):

  - every resource that takes labels carries `dtrain-cluster = <name>` (instances, disks,
    addresses, buckets);
  - networks, subnetworks, routers and firewalls take no labels in Compute v1: the network is named
    `dtrain-<name>` and says "dtrain cluster <name>" in its description; everything on it is the
    cluster's (see dtrain.control.gcp.sweep.find_leftovers).
"""

from __future__ import annotations

from typing import Any

CLUSTER_LABEL = "dtrain-cluster"
NETWORK_PREFIX = "dtrain-"  # infra/modules/plan: name_prefix = "dtrain-${var.cluster_name}"


def label_filter(cluster_name: str) -> str:
    """The server-side filter of a listing: the resources labelled with the cluster."""
    return f'labels.{CLUSTER_LABEL} = "{cluster_name}"'


def labelled(resource: Any, cluster_name: str) -> bool:
    """Whether a listed resource carries the cluster's label."""
    # The server filter narrows the listing; this check is what the code trusts.
    return dict(getattr(resource, "labels", None) or {}).get(CLUSTER_LABEL) == cluster_name
