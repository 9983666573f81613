from opttree._cli import main

raise SystemExit(main())
