"""What every plane uses: the error a user is shown (`errors.UserError`), output files written whole
or not at all (`files.atomic_path`), package attributes imported on first use (`lazy`). Imports
nothing of seqmoe."""
