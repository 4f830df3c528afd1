"""Generation beyond one greedy stream: how drafts are proposed and kept, and the default batch prompts."""
