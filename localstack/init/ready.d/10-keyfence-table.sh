#!/usr/bin/env bash
# LocalStack ready hook: creates keyfence's key table, the same schema that
# `keyfence migrate` creates (src/keystore/table.rs): partition key pk, the
# sparse in-flight GSI sharded by `inflight` and sorted by lease_until, and
# time-to-live on expires_at. Skips a table that already exists.
set -euo pipefail
table=${KEYFENCE_TABLE:-keyfence-keys}

if awslocal dynamodb describe-table --table-name "$table" >/dev/null 2>&1; then
  echo "keyfence: table $table already exists"
  exit 0
fi

awslocal dynamodb create-table \
  --table-name "$table" \
  --billing-mode PAY_PER_REQUEST \
  --attribute-definitions \
      AttributeName=pk,AttributeType=S \
      AttributeName=inflight,AttributeType=S \
      AttributeName=lease_until,AttributeType=N \
  --key-schema AttributeName=pk,KeyType=HASH \
  --global-secondary-indexes '[{
      "IndexName": "inflight-by-lease",
      "KeySchema": [{"AttributeName": "inflight", "KeyType": "HASH"},
                    {"AttributeName": "lease_until", "KeyType": "RANGE"}],
      "Projection": {"ProjectionType": "INCLUDE",
                     "NonKeyAttributes": ["client_id", "idem_key", "fence", "owner",
                                          "home_region", "created_at", "payment_id"]}}]' >/dev/null
awslocal dynamodb wait table-exists --table-name "$table"
awslocal dynamodb update-time-to-live --table-name "$table" \
  --time-to-live-specification Enabled=true,AttributeName=expires_at >/dev/null
echo "keyfence: created table $table"
