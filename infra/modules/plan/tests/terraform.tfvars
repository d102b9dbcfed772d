# The baseline every run starts from (terraform test loads this file for every test file here): a
# valid 2-node L4 cluster. Each run block changes only what it tests.
project_id              = "demo-project"
region                  = "us-central1"
zone                    = "us-central1-a"
cluster_name            = "demo"
worker_count            = 1
use_gpu                 = true
accelerator_type        = "nvidia-l4"
gpus_per_node           = 1
machine_type            = ""
spot                    = false
master_spot             = false
spot_termination_action = "STOP"
disk_size_gb            = 100
disk_type               = "pd-balanced"
ssh_source_ranges       = ["203.0.113.7/32"]
allow_ssh_from_anywhere = false
iap_ssh                 = true
bucket_name             = ""
bucket_lifecycle_days   = 7
labels                  = {}
ssh_user                = "dtrain"
ssh_public_key          = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIClJibl3nhx1XVMqnFsWvLRYwVq0RYIKn7ged3/asfbM dtrain-demo"
external_ip             = true
image_project           = ""
image_family            = ""
subnet_cidr             = "10.42.0.0/24"
