"""Plans: trial runs of a task on candidate groups, the performance model fitted from them,
and the subsets of groups it recommends (docs/architecture.md, "Plans")."""
