import sys

from retrieval.commands import main

sys.exit(main())
