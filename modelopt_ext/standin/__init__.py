"""What every family's stand-in generator shares: the byte-level BPE tokenizer trained on the embedded corpus
(`tokenizer`), the fit of random weights to that corpus (`fit`) and the staged output folder (`files`). A
family's generator itself lives in `models/<family>/standin/`."""
