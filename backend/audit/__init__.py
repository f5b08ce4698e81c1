"""The audit log: one row for every write request to the REST API or the portal, and for
every refused one (who, what, which object, from where, when, with what outcome)."""
