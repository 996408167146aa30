"""What model calls cost and who spent it (docs/model-routing.md): prices,
the ``model_calls`` ledger, and tenants' daily budgets."""
