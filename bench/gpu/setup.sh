# Sourced on the GPU machine from the project root, once the chunks are in /var/tmp/g
# (bench/gpu/unpack.sh); again in each later call on the same machine (then it installs nothing).
G=/var/tmp/g
if [ ! -f /tmp/site/.captiond-gpu ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$G"/whl/*.whl || return 4
  cp -r "$G"/site/* /tmp/site/ && touch /tmp/site/.captiond-gpu
fi
mkdir -p ../shared && rm -rf ../shared/speech ../shared/speech-multi
cp -r "$G/speech" ../shared/speech && cp -r "$G/speech-multi" ../shared/speech-multi
export PYTHONPATH=/tmp/site:$(pwd)/daemon:$(pwd)/clients/python PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
python3 -c "import captiond.cli, faster_whisper, websockets, torch; print('gpu setup:', torch.cuda.get_device_name(), 'torch', torch.__version__, 'websockets', websockets.__version__)" || return 5
