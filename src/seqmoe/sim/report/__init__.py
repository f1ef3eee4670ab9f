"""Result tables, JSONL files and plots."""
