"""`alrira-cache regenerate`: rewrite every assistant turn of a corpus with the target, turn by turn
(docs/design.md, "Regeneration"); the output is a corpus `alrira-cache build` reads as is."""
