"""Weighing the evidence: a protocol-following comparison of sharing strategies (arms, tuning on
validation, compute matched per policy, paired intervals over fresh seeds), its records and its
report."""
