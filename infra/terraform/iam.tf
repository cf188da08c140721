# Two IAM managed policies, least privilege for the two kinds of callers.
# Attach them to the roles your instances and operators assume.
#
# serve: `keyfence serve` works keys and reads clients, but may never write
# a client record, a key pointer or the older layout's client and profile
# items, so a compromised front door cannot mint itself a client or give
# one an account.
# admin: the CLI commands that manage clients, accounts, limits, regions
# and the table.

locals {
  table_arn = "arn:${data.aws_partition.current.partition}:dynamodb:*:${data.aws_caller_identity.current.account_id}:table/${var.table_name}"
  # The table in every replica region, and its index.
  table_arns = [local.table_arn, "${local.table_arn}/index/*"]
}

data "aws_iam_policy_document" "serve" {
  statement {
    sid    = "WorkKeysInEveryReplica"
    effect = "Allow"
    actions = [
      "dynamodb:GetItem",
      # Reading the client directory whole, 100 records a call.
      "dynamodb:BatchGetItem",
      "dynamodb:PutItem",
      "dynamodb:UpdateItem",
      "dynamodb:DeleteItem",
      "dynamodb:Query",
      "dynamodb:Scan",
      "dynamodb:DescribeTable",
    ]
    resources = local.table_arns
  }

  # The operator-only control items: client records and key pointers, and
  # the older layout's client and profile items.
  statement {
    sid    = "NeverWriteClientsKeysOrAccounts"
    effect = "Deny"
    actions = [
      "dynamodb:PutItem",
      "dynamodb:UpdateItem",
      "dynamodb:DeleteItem",
      "dynamodb:BatchWriteItem",
      "dynamodb:PartiQLInsert",
      "dynamodb:PartiQLUpdate",
      "dynamodb:PartiQLDelete",
    ]
    resources = [local.table_arn]
    condition {
      test     = "ForAnyValue:StringLike"
      variable = "dynamodb:LeadingKeys"
      values = [
        "control#clients#*",
        "control#client#*",
        "control#profile#*",
      ]
    }
  }
}

data "aws_iam_policy_document" "admin" {
  statement {
    sid    = "ManageTheKeyTable"
    effect = "Allow"
    actions = [
      "dynamodb:GetItem",
      "dynamodb:BatchGetItem",
      "dynamodb:PutItem",
      "dynamodb:UpdateItem",
      "dynamodb:DeleteItem",
      "dynamodb:Query",
      "dynamodb:Scan",
      "dynamodb:DescribeTable",
      "dynamodb:DescribeTimeToLive",
    ]
    resources = local.table_arns
  }
}

resource "aws_iam_policy" "serve" {
  name        = "${var.table_name}-serve"
  description = "keyfence serve - work idempotency keys and read clients; never write clients, keys or accounts"
  policy      = data.aws_iam_policy_document.serve.json
  tags        = var.tags
}

resource "aws_iam_policy" "admin" {
  name        = "${var.table_name}-admin"
  description = "keyfence CLI - clients, keys, accounts, limits, regions, reconcile, maintain, migrate"
  policy      = data.aws_iam_policy_document.admin.json
  tags        = var.tags
}
