terraform {
  # >= 1.9: variable validations may refer to other objects (the plan module's accelerator table).
  required_version = ">= 1.9"

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
