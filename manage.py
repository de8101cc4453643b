#!/usr/bin/env python
from governance.__main__ import main

if __name__ == "__main__":
    main()
