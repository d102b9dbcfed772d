# The plan module is provider-free on purpose: it only derives values and checks them, so
# `terraform test` can exercise every rule offline (no provider download, no cloud account).
terraform {
  required_version = ">= 1.11"
}
