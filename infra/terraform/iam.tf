# Four IAM managed policies, one per duty, the twins of the CloudFormation
# template's: each allows only the writes its duty makes (reads of the table
# are common to all). Attach them to the roles your instances and operators
# assume.
#
# serve: `keyfence serve` works idempotency keys, refund holds (never
# deleted), hand-offs, clients' webhook endpoints, and its own region's URL
# in the registry (one attribute, named by the role's `keyfence-region` tag:
# tag each region's serve role with its KEYFENCE_REGION). A compromised
# front door cannot declare a region failed, mint a client, or delete a
# balance item.
# sre: `keyfence regions`, `recover`, `reconcile`, `maintain`; no client, no
# endpoint, no secret.
# security: `keyfence clients`, `accounts`, `webhooks`; no idempotency key,
# no region.
# migration: `keyfence migrate`.
# Webhook secrets are sealed with data keys of the multi-Region KMS key
# var.webhook_kms_key_id: serve seals and opens, security and migration
# seal, SREs do neither.

locals {
  table_arn = "arn:${data.aws_partition.current.partition}:dynamodb:*:${data.aws_caller_identity.current.account_id}:table/${var.table_name}"
  # The table in every replica region, and its index.
  table_arns = [local.table_arn, "${local.table_arn}/index/*"]
  # The multi-Region key in every region it is replicated to.
  webhook_key_arn = "arn:${data.aws_partition.current.partition}:kms:*:${data.aws_caller_identity.current.account_id}:key/${var.webhook_kms_key_id}"
}

data "aws_iam_policy_document" "serve" {
  statement {
    sid    = "ReadTheTable"
    effect = "Allow"
    actions = [
      "dynamodb:GetItem",
      # Reading the client directory whole, 100 records a call.
      "dynamodb:BatchGetItem",
      "dynamodb:Query",
      "dynamodb:Scan",
      "dynamodb:DescribeTable",
    ]
    resources = local.table_arns
  }

  # Idempotency keys: every item but the control items.
  statement {
    sid       = "WorkIdempotencyKeys"
    effect    = "Allow"
    actions = [
      "dynamodb:PutItem",
      "dynamodb:UpdateItem",
      "dynamodb:DeleteItem",
    ]
    resources = [local.table_arn]
    condition {
      test     = "ForAllValues:StringNotLike"
      variable = "dynamodb:LeadingKeys"
      values = [
        "control#*",
      ]
    }
  }

  # Refund holds are taken and concluded, never deleted: deleting one would reset its payment's refundable balance.
  statement {
    sid       = "HoldBalances"
    effect    = "Allow"
    actions = [
      "dynamodb:UpdateItem",
    ]
    resources = [local.table_arn]
    condition {
      test     = "ForAllValues:StringLike"
      variable = "dynamodb:LeadingKeys"
      values = [
        "control#balance#*",
      ]
    }
  }

  statement {
    sid       = "HandOffRequestsItTakesOver"
    effect    = "Allow"
    actions = [
      "dynamodb:PutItem",
    ]
    resources = [local.table_arn]
    condition {
      test     = "ForAllValues:StringLike"
      variable = "dynamodb:LeadingKeys"
      values = [
        "control#handoff#*",
      ]
    }
  }

  # One instance at a time sweeps expired keys: the one holding this lease.
  statement {
    sid       = "LeadTheExpirySweep"
    effect    = "Allow"
    actions = [
      "dynamodb:PutItem",
    ]
    resources = [local.table_arn]
    condition {
      test     = "ForAllValues:StringLike"
      variable = "dynamodb:LeadingKeys"
      values = [
        "control#leader#*",
      ]
    }
  }

  # Clients register and remove their own endpoints through the API; the secrets are sealed.
  statement {
    sid       = "KeepWebhookEndpoints"
    effect    = "Allow"
    actions = [
      "dynamodb:PutItem",
    ]
    resources = [local.table_arn]
    condition {
      test     = "ForAllValues:StringLike"
      variable = "dynamodb:LeadingKeys"
      values = [
        "control#webhooks#client#*",
      ]
    }
  }

  # Its own region's URL, one attribute of the registry: never a region's state or another's URL. Tag the role
  # keyfence-region=<its KEYFENCE_REGION>.
  statement {
    sid       = "AdvertiseItsOwnRegion"
    effect    = "Allow"
    actions = [
      "dynamodb:UpdateItem",
    ]
    resources = [local.table_arn]
    condition {
      test     = "ForAllValues:StringEquals"
      variable = "dynamodb:LeadingKeys"
      values = [
        "control#regions",
      ]
    }
    condition {
      test     = "ForAllValues:StringEquals"
      variable = "dynamodb:Attributes"
      values   = ["pk", "url#$${aws:PrincipalTag/keyfence-region}"]
    }
    # The URL itself: never an update that touches nothing (it would make a bare registry).
    condition {
      test     = "ForAnyValue:StringEquals"
      variable = "dynamodb:Attributes"
      values   = ["url#$${aws:PrincipalTag/keyfence-region}"]
    }
    condition {
      test     = "Null"
      variable = "aws:PrincipalTag/keyfence-region"
      values   = ["false"]
    }
  }

  statement {
    sid       = "SealAndOpenWebhookSecrets"
    effect    = "Allow"
    actions = [
      "kms:GenerateDataKey",
      "kms:Decrypt",
    ]
    resources = [local.webhook_key_arn]
    condition {
      test     = "StringEquals"
      variable = "kms:EncryptionContext:purpose"
      values   = ["keyfence-webhook-secrets"]
    }
  }
}

data "aws_iam_policy_document" "sre" {
  statement {
    sid    = "ReadTheTable"
    effect = "Allow"
    actions = [
      "dynamodb:GetItem",
      # Reading the client directory whole, 100 records a call.
      "dynamodb:BatchGetItem",
      "dynamodb:Query",
      "dynamodb:Scan",
      "dynamodb:DescribeTable",
    ]
    resources = local.table_arns
  }

  # Idempotency keys: every item but the control items.
  statement {
    sid       = "WorkIdempotencyKeys"
    effect    = "Allow"
    actions = [
      "dynamodb:PutItem",
      "dynamodb:UpdateItem",
      "dynamodb:DeleteItem",
    ]
    resources = [local.table_arn]
    condition {
      test     = "ForAllValues:StringNotLike"
      variable = "dynamodb:LeadingKeys"
      values = [
        "control#*",
      ]
    }
  }

  statement {
    sid       = "SettleBalances"
    effect    = "Allow"
    actions = [
      "dynamodb:UpdateItem",
    ]
    resources = [local.table_arn]
    condition {
      test     = "ForAllValues:StringLike"
      variable = "dynamodb:LeadingKeys"
      values = [
        "control#balance#*",
      ]
    }
  }

  statement {
    sid       = "HandOffsAndTheirEnd"
    effect    = "Allow"
    actions = [
      "dynamodb:PutItem",
      "dynamodb:DeleteItem",
    ]
    resources = [local.table_arn]
    condition {
      test     = "ForAllValues:StringLike"
      variable = "dynamodb:LeadingKeys"
      values = [
        "control#handoff#*",
      ]
    }
  }

  statement {
    sid       = "DeclareRegions"
    effect    = "Allow"
    actions = [
      "dynamodb:UpdateItem",
    ]
    resources = [local.table_arn]
    condition {
      test     = "ForAllValues:StringEquals"
      variable = "dynamodb:LeadingKeys"
      values = [
        "control#regions",
      ]
    }
  }
}

data "aws_iam_policy_document" "security" {
  statement {
    sid    = "ReadTheTable"
    effect = "Allow"
    actions = [
      "dynamodb:GetItem",
      # Reading the client directory whole, 100 records a call.
      "dynamodb:BatchGetItem",
      "dynamodb:Query",
      "dynamodb:Scan",
      "dynamodb:DescribeTable",
    ]
    resources = local.table_arns
  }

  statement {
    sid       = "ManageClients"
    effect    = "Allow"
    actions = [
      "dynamodb:PutItem",
      "dynamodb:UpdateItem",
      "dynamodb:DeleteItem",
    ]
    resources = [local.table_arn]
    condition {
      test     = "ForAllValues:StringLike"
      variable = "dynamodb:LeadingKeys"
      values = [
        "control#clients#*",
      ]
    }
  }

  statement {
    sid       = "ManageWebhookEndpoints"
    effect    = "Allow"
    actions = [
      "dynamodb:PutItem",
    ]
    resources = [local.table_arn]
    condition {
      test     = "ForAllValues:StringLike"
      variable = "dynamodb:LeadingKeys"
      values = [
        "control#webhooks#client#*",
      ]
    }
  }

  statement {
    sid       = "SealWebhookSecrets"
    effect    = "Allow"
    actions = [
      "kms:GenerateDataKey",
    ]
    resources = [local.webhook_key_arn]
    condition {
      test     = "StringEquals"
      variable = "kms:EncryptionContext:purpose"
      values   = ["keyfence-webhook-secrets"]
    }
  }
}

data "aws_iam_policy_document" "migration" {
  statement {
    sid    = "ReadTheTable"
    effect = "Allow"
    actions = [
      "dynamodb:GetItem",
      # Reading the client directory whole, 100 records a call.
      "dynamodb:BatchGetItem",
      "dynamodb:Query",
      "dynamodb:Scan",
      "dynamodb:DescribeTable",
    ]
    resources = local.table_arns
  }

  statement {
    sid    = "MakeAndCheckTheTable"
    effect = "Allow"
    actions = [
      "dynamodb:CreateTable",
      "dynamodb:DescribeTimeToLive",
      "dynamodb:UpdateTimeToLive",
    ]
    resources = [local.table_arn]
  }

  statement {
    sid       = "CarryControlItems"
    effect    = "Allow"
    actions = [
      "dynamodb:PutItem",
      "dynamodb:UpdateItem",
      "dynamodb:DeleteItem",
    ]
    resources = [local.table_arn]
    condition {
      test     = "ForAllValues:StringLike"
      variable = "dynamodb:LeadingKeys"
      values = [
        "control#clients#*",
        "control#client#*",
        "control#profile#*",
        "control#webhooks#client#*",
      ]
    }
  }

  statement {
    sid       = "MakeTheRegistry"
    effect    = "Allow"
    actions = [
      "dynamodb:UpdateItem",
    ]
    resources = [local.table_arn]
    condition {
      test     = "ForAllValues:StringEquals"
      variable = "dynamodb:LeadingKeys"
      values = [
        "control#regions",
      ]
    }
  }

  statement {
    sid       = "SealWebhookSecrets"
    effect    = "Allow"
    actions = [
      "kms:GenerateDataKey",
    ]
    resources = [local.webhook_key_arn]
    condition {
      test     = "StringEquals"
      variable = "kms:EncryptionContext:purpose"
      values   = ["keyfence-webhook-secrets"]
    }
  }
}

resource "aws_iam_policy" "serve" {
  name        = "${var.table_name}-serve"
  description = "keyfence serve - work idempotency keys, hold balances, keep endpoints, advertise its own region; never clients, regions' states or the table"
  policy      = data.aws_iam_policy_document.serve.json
  tags        = var.tags
}

resource "aws_iam_policy" "sre" {
  name        = "${var.table_name}-sre"
  description = "keyfence for SREs - declare regions failed or restored, recover, reconcile, maintain; never clients, endpoints or secrets"
  policy      = data.aws_iam_policy_document.sre.json
  tags        = var.tags
}

resource "aws_iam_policy" "security" {
  name        = "${var.table_name}-security"
  description = "keyfence for security - clients, their keys, accounts and limits, webhook endpoints; never idempotency keys or regions"
  policy      = data.aws_iam_policy_document.security.json
  tags        = var.tags
}

resource "aws_iam_policy" "migration" {
  name        = "${var.table_name}-migration"
  description = "keyfence migrate - make and check the table, make the registry, carry older items, seal secrets kept in the clear"
  policy      = data.aws_iam_policy_document.migration.json
  tags        = var.tags
}
