"""The live KV-cache dashboard at ``/dashboard`` (docs/dashboard.md): ``hub`` polls the engine and
streams to the pages, ``router`` serves them, ``static`` holds the page itself."""
