"""What every plane uses: the error a user is shown (`errors.UserError`) and output files written
whole or not at all (`files.atomic_path`). Imports nothing of seqmoe."""
