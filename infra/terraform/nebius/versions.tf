terraform {
  # 1.9: variable validations may refer to other variables (subnet inside network, fabric vs preset)
  required_version = ">= 1.9"
  required_providers {
    nebius = {
      source = "nebius/nebius"
      # 0.6.8 is the first release on the public registry without the removed v1alpha1 compute
      # resources; every resource and argument used here is in the 0.6.x documentation.
      version = ">= 0.6.8, < 1.0"
    }
  }
}

# Credentials come from the environment, never from this directory: NEBIUS_IAM_TOKEN
# (`export NEBIUS_IAM_TOKEN=$(nebius iam get-access-token)`, 12 h) for a person, or a service
# account through the provider's service_account settings for automation (see README.md).
provider "nebius" {}
