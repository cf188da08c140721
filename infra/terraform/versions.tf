terraform {
  required_version = ">= 1.5.7"

  required_providers {
    aws = {
      source = "hashicorp/aws"
      # 6.22 is the first release with the table's global_table_witness
      # block (two replicas and a witness); replica consistency_mode and
      # replica deletion protection came earlier in 6.x.
      version = ">= 6.22, < 7.0"
    }
  }
}
