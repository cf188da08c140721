variable "table_name" {
  description = "Name of the key table, the same in every region (KEYFENCE_TABLE of every keyfence instance)."
  type        = string
  default     = "keyfence-keys"
}

variable "replica_region" {
  description = "Second replica region. The first is the region of the aws provider this module is given; both must be in the third region's region set."
  type        = string
}

variable "third_region" {
  description = "Third region of the region set (US: us-east-1, us-east-2, us-west-2; EU: eu-west-1, eu-west-2, eu-west-3, eu-central-1; AP: ap-northeast-1, ap-northeast-2, ap-northeast-3)."
  type        = string
}

variable "third_region_role" {
  description = "replica: a full replica, keyfence can run there too. witness: it votes on every write but holds no data to serve."
  type        = string
  default     = "replica"

  validation {
    condition     = contains(["replica", "witness"], var.third_region_role)
    error_message = "third_region_role must be \"replica\" or \"witness\"."
  }
}

variable "kms_key_arns" {
  description = "Customer-managed KMS keys for encryption at rest, region => key ARN: either empty (DynamoDB's AWS-owned key) or one key for every region that holds a replica (a witness holds none)."
  type        = map(string)
  default     = {}
}

variable "webhook_kms_key_id" {
  description = "The multi-Region KMS key (mrk-..., replicated to every region keyfence serves in) that seals webhook secrets; KEYFENCE_WEBHOOK_KMS_KEY names it."
  type        = string

  validation {
    condition     = can(regex("^mrk-[0-9a-f]{32}$", var.webhook_kms_key_id))
    error_message = "webhook_kms_key_id must be a multi-Region key's id (mrk- and 32 hex digits)."
  }
}

variable "tags" {
  description = "Tags for the table (propagated to every replica) and the four policies."
  type        = map(string)
  default     = {}
}
