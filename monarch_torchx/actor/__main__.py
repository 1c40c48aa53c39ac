from monarch_torchx.actor.proc import main

main()
