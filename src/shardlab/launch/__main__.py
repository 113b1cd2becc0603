from shardlab.launch import main

raise SystemExit(main())
