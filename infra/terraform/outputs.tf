output "table_name" {
  description = "The key table's name (KEYFENCE_TABLE)."
  value       = aws_dynamodb_table.keys.name
}

output "table_arn" {
  description = "ARN of the table in the provider's region."
  value       = aws_dynamodb_table.keys.arn
}

output "replica_arns" {
  description = "ARNs of the table in the other replica regions, region => ARN."
  value       = { for r in aws_dynamodb_table.keys.replica : r.region_name => r.arn }
}

output "witness_region" {
  description = "The witness region, or null with three replicas."
  value       = var.third_region_role == "witness" ? var.third_region : null
}

output "serve_policy_arn" {
  description = "Policy for the roles `keyfence serve` runs as."
  value       = aws_iam_policy.serve.arn
}

output "sre_policy_arn" {
  description = "Policy for the role SREs run `keyfence regions`, `recover`, `reconcile` and `maintain` as."
  value       = aws_iam_policy.sre.arn
}

output "security_policy_arn" {
  description = "Policy for the role `keyfence clients`, `accounts` and `webhooks` run as."
  value       = aws_iam_policy.security.arn
}

output "migration_policy_arn" {
  description = "Policy for the role `keyfence migrate` runs as."
  value       = aws_iam_policy.migration.arn
}
