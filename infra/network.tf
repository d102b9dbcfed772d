resource "google_compute_network" "cluster" {
  name                    = module.plan.name_prefix
  description             = "dtrain cluster ${var.cluster_name}"
  auto_create_subnetworks = false
  routing_mode            = "REGIONAL"
}

resource "google_compute_subnetwork" "cluster" {
  name          = module.plan.name_prefix
  region        = var.region
  network       = google_compute_network.cluster.id
  ip_cidr_range = var.subnet_cidr
  # Nodes reach Cloud Storage and Artifact Registry on Google's network, external IP or not.
  private_ip_google_access = true

  # Flow logs make "NCCL cannot connect" debuggable; 5-minute aggregation and half sampling keep
  # their volume small next to the training traffic.
  log_config {
    aggregation_interval = "INTERVAL_5_MIN"
    flow_sampling        = 0.5
    metadata             = "INCLUDE_ALL_METADATA"
  }
}

# SSH from the listed ranges (and IAP's range when iap_ssh) only; module.plan refuses 0.0.0.0/0
# unless allow_ssh_from_anywhere, and an empty source list.
resource "google_compute_firewall" "ssh" {
  name        = "${module.plan.name_prefix}-ssh"
  network     = google_compute_network.cluster.id
  description = "SSH to dtrain cluster ${var.cluster_name} nodes"
  direction   = "INGRESS"
  priority    = 1000

  source_ranges = module.plan.ssh_source_ranges
  target_tags   = [module.plan.network_tag]

  allow {
    protocol = "tcp"
    ports    = ["22"]
  }

  log_config {
    metadata = "INCLUDE_ALL_METADATA"
  }
}

# Everything between the cluster's own nodes: torchrun's rendezvous store (TCP 29500 by default)
# and NCCL / gloo, which open connections on ephemeral TCP ports chosen at run time; UDP and ICMP
# for NCCL's socket transport probes and for ping when debugging. Scoped by tag at both ends, so
# no other VM in the project (and nothing outside) matches.
resource "google_compute_firewall" "internal" {
  name        = "${module.plan.name_prefix}-internal"
  network     = google_compute_network.cluster.id
  description = "Traffic between dtrain cluster ${var.cluster_name} nodes"
  direction   = "INGRESS"
  priority    = 1000

  source_tags = [module.plan.network_tag]
  target_tags = [module.plan.network_tag]

  allow {
    protocol = "tcp"
  }
  allow {
    protocol = "udp"
  }
  allow {
    protocol = "icmp"
  }

  log_config {
    metadata = "INCLUDE_ALL_METADATA"
  }
}

# Nodes without external IPs still need the internet for apt (docker.io on CPU nodes, the NVIDIA
# container toolkit if an image lacks it) and for public base images.
resource "google_compute_router" "nat" {
  count   = module.plan.nat ? 1 : 0
  name    = "${module.plan.name_prefix}-nat"
  region  = var.region
  network = google_compute_network.cluster.id
}

resource "google_compute_router_nat" "nat" {
  count                              = module.plan.nat ? 1 : 0
  name                               = "${module.plan.name_prefix}-nat"
  router                             = google_compute_router.nat[0].name
  region                             = var.region
  nat_ip_allocate_option             = "AUTO_ONLY"
  source_subnetwork_ip_ranges_to_nat = "LIST_OF_SUBNETWORKS"

  subnetwork {
    name                    = google_compute_subnetwork.cluster.id
    source_ip_ranges_to_nat = ["ALL_IP_RANGES"]
  }

  log_config {
    enable = true
    filter = "ERRORS_ONLY"
  }
}
