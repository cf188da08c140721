# keyfence's key table on AWS as a DynamoDB global table, the Terraform
# twin of infra/key-table.cfn.yaml: the same schema as `keyfence migrate`
# creates locally (infra/key-table.schema.json, which scripts/lint-infra
# checks this file and the template against), the same replicas and the
# same two IAM policies (iam.tf).
#
# Claims must be arbitrated by one consistent view across regions, so the
# table uses multi-Region strong consistency (MRSC): a conditional write is
# checked against the latest version of the item whichever region sends
# it, and two regions can never both win one claim. MRSC spans exactly
# three regions of one region set: the provider's region and
# var.replica_region hold replicas, var.third_region a third replica or a
# witness (it votes on every write but holds no data to serve).
#
# MRSC tables support neither time-to-live nor transactions: there is no
# ttl block, and keyfence expires keys itself (claims treat an item past
# `expires_at` as absent; run `keyfence maintain --expire` on a schedule,
# or set KEYFENCE_EXPIRE_INTERVAL_MS on `serve`). keyfence uses no
# transactions.

data "aws_region" "current" {}
data "aws_partition" "current" {}
data "aws_caller_identity" "current" {}

locals {
  region_sets = {
    US = ["us-east-1", "us-east-2", "us-west-2"]
    EU = ["eu-west-1", "eu-west-2", "eu-west-3", "eu-central-1"]
    AP = ["ap-northeast-1", "ap-northeast-2", "ap-northeast-3"]
  }
  home_region = data.aws_region.current.region
  regions     = [local.home_region, var.replica_region, var.third_region]
  # The regions beside the provider's that hold a replica.
  replica_regions = var.third_region_role == "replica" ? [var.replica_region, var.third_region] : [var.replica_region]
  # Every region that holds data (and so needs a KMS key if any is given).
  data_regions = concat([local.home_region], local.replica_regions)
  # The projection the recovery worker reads stale leases from.
  inflight_projection = ["client_id", "idem_key", "fence", "owner", "home_region", "created_at", "payment_id"]
}

resource "aws_dynamodb_table" "keys" {
  name         = var.table_name
  billing_mode = "PAY_PER_REQUEST"
  hash_key     = "pk"

  attribute {
    name = "pk"
    type = "S"
  }

  attribute {
    name = "inflight"
    type = "S"
  }

  attribute {
    name = "lease_until"
    type = "N"
  }

  # Sparse: only started items carry `inflight` (one of 16 shards), so the
  # recovery worker finds stale leases without scanning the table.
  global_secondary_index {
    name               = "inflight-by-lease"
    hash_key           = "inflight"
    range_key          = "lease_until"
    projection_type    = "INCLUDE"
    non_key_attributes = local.inflight_projection
  }

  # The table holds every answer clients are replayed: it is restorable to
  # any second of the last 35 days, and cannot be deleted by accident.
  point_in_time_recovery {
    enabled = true
  }
  deletion_protection_enabled = true

  # Without keys, DynamoDB encrypts with its AWS-owned key (as the
  # CloudFormation template does without KmsKeyArn).
  dynamic "server_side_encryption" {
    for_each = length(var.kms_key_arns) > 0 ? [lookup(var.kms_key_arns, local.home_region, null)] : []
    content {
      enabled     = true
      kms_key_arn = server_side_encryption.value
    }
  }

  dynamic "replica" {
    for_each = local.replica_regions
    content {
      region_name                 = replica.value
      consistency_mode            = "STRONG"
      point_in_time_recovery      = true
      deletion_protection_enabled = true
      propagate_tags              = true
      kms_key_arn                 = lookup(var.kms_key_arns, replica.value, null)
    }
  }

  dynamic "global_table_witness" {
    for_each = var.third_region_role == "witness" ? [var.third_region] : []
    content {
      region_name = global_table_witness.value
    }
  }

  tags = var.tags

  lifecycle {
    # Like DeletionPolicy/UpdateReplacePolicy Retain in the template: a
    # destroy, or a change that would replace the table, is refused rather
    # than losing the answers clients are replayed. Deletion protection
    # covers what this cannot (the block removed from the configuration).
    prevent_destroy = true

    precondition {
      condition     = length(distinct(local.regions)) == 3 && anytrue([for rs in values(local.region_sets) : alltrue([for r in local.regions : contains(rs, r)])])
      error_message = "MRSC needs three different regions of one region set (the provider's region, replica_region, third_region)."
    }

    precondition {
      condition     = length(var.kms_key_arns) == 0 || (length(var.kms_key_arns) == length(local.data_regions) && alltrue([for r in local.data_regions : contains(keys(var.kms_key_arns), r)]))
      error_message = "kms_key_arns must be empty or name exactly the regions that hold a replica."
    }
  }
}
